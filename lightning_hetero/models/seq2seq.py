"""LightningModule for Hugging Face encoder-decoder models (T5)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity
from transformers import AutoModelForSeq2SeqLM, PretrainedConfig
from typing_extensions import override

from lightning_hetero.models.base import HFModuleBase
from lightning_hetero.models.causal_lm import IGNORE_INDEX


class Seq2SeqModule(HFModuleBase):
    """Sequence-to-sequence training with an HF ``AutoModelForSeq2SeqLM`` (``T5ForConditionalGeneration``).

    Batches are dicts ``{"input_ids": LongTensor[B, S], "attention_mask": LongTensor[B, S], "labels":
    LongTensor[B, T]}`` with target padding set to -100; the model builds its decoder inputs by shifting ``labels``
    right behind ``decoder_start_token_id``. Logs ``train/loss``; ``val/loss``, ``val/perplexity`` and
    ``val/token_accuracy`` (micro-averaged over non-padding target tokens), and the same under ``test/``.

    Args:
        preset: Preset name (``"t5-tiny"``, ``"t5-small"``); ignored when ``pretrained`` is set.
        *args: The other arguments of :class:`HFModuleBase`, in its order.
        **kwargs: The same, by name.
    """

    auto_model_class = AutoModelForSeq2SeqLM
    progress_bar_metric = "token_accuracy"

    def __init__(self, preset: str | None = "t5-tiny", *args: Any, **kwargs: Any) -> None:
        # Only the default preset differs from HFModuleBase; LightningCLI resolves the other arguments through
        # the forwarding call, so YAML `init_args` and positional calls keep the base class' full signature.
        super().__init__(preset, *args, **kwargs)

    @override
    def validate_config(self, config: PretrainedConfig) -> None:
        # transformers 5 no longer defaults it, and the model cannot shift labels into decoder inputs without it.
        if getattr(config, "decoder_start_token_id", None) is None:
            raise ValueError(
                "The seq2seq config has no decoder_start_token_id, so labels cannot be shifted into decoder inputs. "
                "Set config={'decoder_start_token_id': <pad id, usually 0>} or provide it from the datamodule's "
                "hf_config_overrides()."
            )

    @override
    def build_metrics(self, config: PretrainedConfig) -> dict[str, Metric]:
        return {
            "perplexity": Perplexity(ignore_index=IGNORE_INDEX),
            "token_accuracy": MulticlassAccuracy(
                num_classes=config.vocab_size, average="micro", ignore_index=IGNORE_INDEX
            ),
        }

    @override
    def update_metrics(self, metrics: nn.ModuleDict, outputs: Any, batch: Mapping[str, torch.Tensor]) -> None:
        # Decoder position t predicts labels[t] directly (no shift: the model shifted the decoder inputs).
        logits = outputs.logits.float()
        labels = batch["labels"]
        metrics["perplexity"].update(logits, labels)
        metrics["token_accuracy"].update(logits.argmax(dim=-1).flatten(), labels.flatten())

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """``generated``: greedy output token ids per source (as long as the labels, or 64 tokens without labels)."""
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}.model is not built yet: call configure_model() first.")
        max_new_tokens = batch["labels"].shape[1] if "labels" in batch else 64
        generated = self.model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
        return {"generated": generated}
