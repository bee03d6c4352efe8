"""Tiny models and batches for the layerwise tests."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageClassification

from lightning_hetero.models.presets import build_config

TINY_VIT = {"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
TINY_TEXT = {"llama-tiny": {"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64, "vocab_size": 64},
             "gpt2-tiny": {"n_layer": 3, "n_embd": 32, "vocab_size": 64}}  # fmt: skip


def tiny_model(family: str) -> nn.Module:
    """A 3-unit model of ``family`` ("vit", "llama", "gpt2", "cnn"), in eval mode is up to the caller."""
    if family == "vit":
        return AutoModelForImageClassification.from_config(build_config("vit-tiny", TINY_VIT))
    if family in ("llama", "gpt2"):
        preset = f"{family}-tiny"
        return AutoModelForCausalLM.from_config(build_config(preset, TINY_TEXT[preset]))
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 7 * 7, 10),
    )  # fmt: skip


def tiny_batch(family: str, rows: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch dict for ``family`` (text: right padding on the last row)."""
    generator = torch.Generator().manual_seed(seed)
    if family in ("vit", "cnn"):
        return {
            "pixel_values": torch.randn(rows, 1, 28, 28, generator=generator),
            "labels": torch.randint(0, 10, (rows,), generator=generator),
        }
    ids = torch.randint(3, 64, (rows, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
