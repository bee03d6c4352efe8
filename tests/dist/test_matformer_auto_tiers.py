"""``tiers: auto`` on 2 spawned CPU ranks (gloo): a memory-limited rank 1 gets a narrower tier, both ranks hold the
same choice, and training runs on it.

The model is the tiny Llama with very wide FFNs (2 x 3 x 32 x 131072 = 25.2M FFN parameters, 100 MB in float32), so
that one tier's training state (weights, gradients, two AdamW moments: about 400 MB at tier 0, 200 MB at tier 1)
stands out of the process's own footprint. Rank 1's limit is this (test) process's resident set plus 300 MB: below the
tier-0 training peak of a spawned rank, above tier 2's.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero import MatFormerStrategy
from lightning_hetero.hetero.measure import peak_memory_bytes, reset_peak_memory
from lightning_hetero.hetero.tier_settings import AutoTierSettings
from lightning_hetero.matformer import find_ffns
from lightning_hetero.matformer.settings import MatFormerSettings
from tests.fixtures import TinyLlama, TokenData, fit_ranks
from tests.token_data import TINY_LLAMA

WIDE = 131072
MIB = 2**20


class WideLlama(TinyLlama):
    """:class:`TinyLlama` with FFNs of width 131072 (module level: pickled for spawn)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "intermediate_size": WIDE}))


def _auto_fields(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    runtime = trainer.strategy.runtime
    return {
        "tier": trainer.strategy.tier,
        "per_rank": runtime.per_rank,
        "choice": runtime.auto_choice.to_json(),
        "lines": runtime.auto_choice.lines,
        "probe_seconds": runtime.auto_probe_seconds,
        "ffn_width": find_ffns(pl_module)[0].width,
    }


@pytest.mark.timeout(600)
def test_memory_limited_rank_gets_a_narrower_tier_and_trains(tmp_path):
    reset_peak_memory(torch.device("cpu"))
    here = peak_memory_bytes(torch.device("cpu"))
    limit = here + 300 * MIB
    settings = MatFormerSettings(
        tiers="auto",
        auto_tiers=AutoTierSettings(
            max_slowdown=100.0,  # memory decides here: two ranks on shared cores time too noisily for a speed test
            memory_headroom=0.0,
            probe_repeats=1,
            memory_limit_bytes=[None, limit],
        ),
    )
    records = fit_ranks(
        tmp_path,
        WideLlama(),
        TokenData(4, batch_size=2),
        MatFormerStrategy(settings=settings, start_method="spawn"),
        max_steps=3,
        recorder={"fields": _auto_fields, "keep": ("metrics",)},
    )
    first, second = records
    assert first["choice"] == second["choice"] and first["per_rank"] == second["per_rank"]
    assert first["tier"] == 0 and first["ffn_width"] == WIDE
    assert second["tier"] in (1, 2, 3), second["lines"]
    assert second["ffn_width"] == WIDE >> second["tier"]
    assert first["per_rank"] == [0, second["tier"]]
    assert "rank 1: tier" in second["lines"][1] and "limit" in second["lines"][1]
    assert all(len(record["losses"]) == 3 for record in records)
    assert all(torch.isfinite(torch.tensor(record["losses"])).all() for record in records)
