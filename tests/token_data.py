"""Tiny learnable token data shared by the strategy tests (importable from spawned ranks as ``tests.token_data``)."""

from __future__ import annotations

import torch

VOCAB = 64
"""Vocabulary size of the tiny test models."""


def progressions(count: int, length: int = 12) -> list[dict[str, torch.Tensor]]:
    """``count`` arithmetic progressions mod VOCAB (seeded): the next token follows from the previous two, so the loss
    of a tiny model falls within a few steps. Each item has ``input_ids`` and equal ``labels``."""
    generator = torch.Generator().manual_seed(1)
    starts = torch.randint(0, VOCAB, (count,), generator=generator)
    strides = torch.randint(1, 5, (count,), generator=generator)
    ids = (starts[:, None] + torch.arange(length)[None] * strides[:, None]) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in ids]
