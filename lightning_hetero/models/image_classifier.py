"""LightningModule for Hugging Face image classifiers (ViT)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from transformers import AutoModelForImageClassification, PretrainedConfig
from typing_extensions import override

from lightning_hetero.models.base import HFModuleBase


class ImageClassifierModule(HFModuleBase):
    """Image classification with an HF ``AutoModelForImageClassification`` (``ViTForImageClassification``).

    Batches are dicts ``{"pixel_values": FloatTensor[B, C, H, W], "labels": LongTensor[B]}``. Logs ``train/loss``;
    ``val/loss`` and ``val/accuracy`` (fraction of correct images), and the same under ``test/``. A datamodule
    sets the geometry through ``hf_config_overrides()`` (``image_size``, ``num_channels``, ``num_labels``);
    ``patch_size`` must divide ``image_size`` (8x8 digits: 4 or 8; 28x28 MNIST: 4, 7, 14 or 28).

    Args:
        preset: Preset name (``"vit-tiny"``, ``"vit-small"``); ignored when ``pretrained`` is set.
        *args: The other arguments of :class:`HFModuleBase`, in its order (weight decay spares the [CLS] token and
            the position embeddings; ``gguf_file`` is rarely useful for vision models).
        **kwargs: The same, by name.
    """

    auto_model_class = AutoModelForImageClassification
    progress_bar_metric = "accuracy"

    def __init__(self, preset: str | None = "vit-tiny", *args: Any, **kwargs: Any) -> None:
        # Only the default preset differs from HFModuleBase; LightningCLI resolves the other arguments through
        # the forwarding call, so YAML `init_args` and positional calls keep the base class' full signature.
        super().__init__(preset, *args, **kwargs)

    @override
    def validate_config(self, config: PretrainedConfig) -> None:
        image_sides = _pair(config.image_size)
        patch_sides = _pair(config.patch_size)
        if any(image % patch for image, patch in zip(image_sides, patch_sides, strict=True)):
            divisors = sorted({d for d in range(1, min(image_sides) + 1) if all(side % d == 0 for side in image_sides)})
            raise ValueError(
                f"patch_size={config.patch_size} does not divide image_size={config.image_size}: the image cannot be "
                f"cut into whole patches. Set config={{'patch_size': p}} with p in {divisors}."
            )
        if config.num_labels < 2:
            raise ValueError(f"num_labels must be >= 2 for classification, got {config.num_labels}.")

    @override
    def build_metrics(self, config: PretrainedConfig) -> dict[str, Metric]:
        return {"accuracy": MulticlassAccuracy(num_classes=config.num_labels, average="micro")}

    @override
    def update_metrics(self, metrics: nn.ModuleDict, outputs: Any, batch: Mapping[str, torch.Tensor]) -> None:
        metrics["accuracy"].update(outputs.logits.argmax(dim=-1), batch["labels"])

    @override
    def predictions(self, outputs: Any, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``predictions``: the most likely class per image; ``probabilities``: the softmax over classes."""
        probabilities = outputs.logits.float().softmax(dim=-1)
        return {"predictions": probabilities.argmax(dim=-1), "probabilities": probabilities}


def _pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """ViT accepts an int or an (height, width) pair for image and patch sizes."""
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))
