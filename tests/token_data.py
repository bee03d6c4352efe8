"""Tiny learnable token data and the tiny Llama sizes shared by the strategy tests (no Lightning here).

Importable from spawned ranks as ``tests.token_data``.
"""

from __future__ import annotations

import torch

VOCAB = 64
"""Vocabulary size of the tiny test models."""

TINY_LLAMA = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}
"""``LlamaConfig`` keywords of the tiny Llama the strategy tests train (``tie_word_embeddings`` is each test's own)."""


def progression_ids(count: int, length: int, seed: int) -> torch.Tensor:
    """``count`` arithmetic progressions mod VOCAB, one row each (random starts and strides 1-4 from ``seed``): the next
    token follows from the previous two, so the loss of a tiny model falls within a few steps."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (count,), generator=generator)
    strides = torch.randint(1, 5, (count,), generator=generator)
    return (starts[:, None] + torch.arange(length)[None] * strides[:, None]) % VOCAB


def progressions(count: int, length: int = 12) -> list[dict[str, torch.Tensor]]:
    """``count`` :func:`progression_ids` rows (seed 1) as items with ``input_ids`` and equal ``labels``."""
    return [{"input_ids": row, "labels": row.clone()} for row in progression_ids(count, length, seed=1)]
