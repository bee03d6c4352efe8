"""The strategies the reliability and SmolLM2 fine-tune recipes build, and the mid-epoch resume cases, take the typed
settings (issue 23): each builds without a process group and carries the settings its docs describe.

The recipes themselves run for minutes (torchrun agents, the bandwidth testbed); a strategy or settings object built
with a keyword removed in 0.2 raises ``RenamedSettingError`` at construction, which these catch in milliseconds.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.matformer.settings import MatFormerSettings
from lightning_hetero.replication.settings import ReplicationSettings
from lightning_hetero.sparseflip.settings import SparseFlipSettings
from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings
from lightning_hetero.testing.resume import CASES, _strategy

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
sys.path[:0] = [str(RECIPES / "finetune"), str(RECIPES / "reliability")]

import finetune_smollm2_worker  # noqa: E402
import reliability_elastic  # noqa: E402
import reliability_worker  # noqa: E402


def test_resume_cases_build_their_strategies_with_settings() -> None:
    built = {case: _strategy(case) for case in CASES}
    demo, diloco = built["flexdemo/demo"].settings, built["flexdemo/diloco"].settings
    assert demo == FlexDeMoSettings(
        replication=ReplicationSettings(kind="demo", kept_fraction=1 / 8), shard_size=1, drift_check_every=4
    )
    assert diloco == FlexDeMoSettings(
        replication=ReplicationSettings(kind="diloco", sync_every=3, outer_lr=0.8, outer_momentum=0.5), shard_size=1
    )
    matformer = built["matformer/mixed-tiers"].settings
    assert isinstance(matformer, MatFormerSettings) and (matformer.tiers, matformer.mode) == ([0, 1], "demo")
    assert matformer.replication is not None and matformer.replication.kept_fraction == 0.25
    subspace = built["subspace/pipeline"].settings
    assert isinstance(subspace, SubspacePipelineSettings)
    assert (subspace.pipeline.num_stages, subspace.subspace_dim, subspace.n_microbatches, subspace.update_every) == (
        2, 8, 2, 3,
    )  # fmt: skip
    lowbit = built["sparseflip/low-bit"].settings
    assert isinstance(lowbit, SparseFlipSettings)
    assert (lowbit.flip.max_per_step, lowbit.flip.bop_gamma, lowbit.fp_sync.kept_fraction) == (16, 0.3, 0.25)
    assert lowbit.drift_check_every == 4


@pytest.mark.parametrize("name", reliability_worker.STRATEGIES)
def test_reliability_worker_strategies_keep_the_timeout(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")  # the subspace pipeline: 2 stages x 2 replicas
    strategy = reliability_worker.build_strategy(name, 7.0)
    assert strategy._timeout == timedelta(seconds=7.0)
    if name == "subspace":
        settings = strategy.settings
        assert (settings.pipeline.num_stages, settings.pipeline.data_parallel_size) == (2, 2)
        assert (settings.subspace_dim, settings.n_microbatches) == (8, 2)
    if name == "sparseflip":
        assert (strategy.settings.flip.max_per_step, strategy.settings.flip.bop_gamma) == (16, 0.3)


def test_reliability_elastic_strategy() -> None:
    strategy = reliability_elastic.build_strategy(12.0)
    assert strategy._timeout == timedelta(seconds=12.0)
    assert strategy.settings == FlexDeMoSettings(
        replication=ReplicationSettings(kind="demo", kept_fraction=1 / 4), overlap=False
    )


def _worker_args(**overrides: object) -> argparse.Namespace:
    defaults = {
        "replicator": "demo", "compression": 1 / 32, "values": "sign", "compress": False, "ssn_compression": 16.0,
        "coord_dtype": "fp32", "microbatches": 2, "seed": 0,
    }  # fmt: skip
    return argparse.Namespace(**{**defaults, **overrides})


def test_finetune_worker_flags_reach_the_settings() -> None:
    strategy = finetune_smollm2_worker.flexdemo_strategy(_worker_args(replicator="topk", compression=0.25))
    assert strategy.settings.replication == ReplicationSettings(kind="topk", kept_fraction=0.25, values="sign")
    plain = finetune_smollm2_worker.pipeline_settings(_worker_args(), num_stages=2)
    assert (plain.compress, plain.dim_ratio, plain.pipeline.num_stages, plain.schedule) == (False, None, 2, "1f1b")
    ssn = finetune_smollm2_worker.pipeline_settings(_worker_args(compress=True, coord_dtype="bf16", seed=3), 2)
    assert (ssn.compress, ssn.dim_ratio, ssn.pipeline.boundary_dtype, ssn.seed) == (True, 16.0, "bf16", 3)


def test_finetune_worker_bad_flag_names_the_setting() -> None:
    with pytest.raises(ValueError, match=r"ReplicationSettings\.kept_fraction=1\.5"):
        finetune_smollm2_worker.flexdemo_strategy(_worker_args(compression=1.5))
