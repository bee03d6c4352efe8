"""Helpers for the model tests: random batches and a fake Trainer that carries a datamodule."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


class OverridesDataModule:
    """Stands in for a LightningDataModule that implements the ``hf_config_overrides()`` protocol."""

    def __init__(self, overrides: Any) -> None:
        self.overrides = overrides

    def hf_config_overrides(self) -> Any:
        return self.overrides


def attach_datamodule(module: Any, overrides: Any) -> None:
    """Attach a minimal trainer whose ``datamodule`` returns ``overrides`` (enough for ``configure_model``)."""
    module.trainer = SimpleNamespace(datamodule=OverridesDataModule(overrides))


def token_batch(vocab_size: int, batch_size: int = 2, length: int = 12, pad: int = 3) -> dict[str, torch.Tensor]:
    """A causal-LM batch whose last ``pad`` positions are padding (label -100, attention 0)."""
    input_ids = torch.randint(3, vocab_size, (batch_size, length))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, length - pad :] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def seq2seq_batch(vocab_size: int, batch_size: int = 2, source: int = 10, target: int = 7) -> dict[str, torch.Tensor]:
    labels = torch.randint(3, vocab_size, (batch_size, target))
    labels[:, -2:] = -100
    return {
        "input_ids": torch.randint(3, vocab_size, (batch_size, source)),
        "attention_mask": torch.ones(batch_size, source, dtype=torch.long),
        "labels": labels,
    }


def image_batch(
    batch_size: int = 4, channels: int = 1, size: int = 28, num_labels: int = 10
) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.randn(batch_size, channels, size, size),
        "labels": torch.randint(0, num_labels, (batch_size,)),
    }
