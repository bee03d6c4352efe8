"""SparseFlipStrategy on 2 spawned CPU ranks (gloo): replicas bit-identical, server == all-gather, exact resume, Fabric.

Every fit spawns its own ranks. Each epoch is one batch per rank (32 samples, batch 16, 2 ranks), so a resumed run
sees the same batches whatever Lightning does when it re-enters an epoch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero import SparseFlipStrategy
from lightning_hetero.fabric import SparseFlipStrategy as FabricSparseFlipStrategy
from lightning_hetero.sparseflip import CodeExchangeSettings, FlipSettings, FpSyncSettings, SparseFlipSettings
from tests.fixtures import fit_ranks
from tests.unit.sparseflip.test_strategy import DigitsMLP

pytestmark = pytest.mark.timeout(600)


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=generator)
    return TensorDataset(x, x[:, :4].argmax(dim=1).long())


FLIP = FlipSettings(max_per_step=16, bop_gamma=0.3)


def _fit(
    out: Path,
    max_steps: int,
    checkpoint: Path | None = None,
    ckpt_path: Path | None = None,
    aggregation: Literal["server", "allgather"] = "server",
    fp_kept_fraction: float | None = None,
):
    settings = SparseFlipSettings(
        flip=FLIP,
        exchange=CodeExchangeSettings(aggregation=aggregation),
        fp_sync=FpSyncSettings(kept_fraction=fp_kept_fraction),
        drift_check_every=2,
    )
    strategy = SparseFlipStrategy(settings, start_method="spawn")
    data = DataLoader(_dataset(), batch_size=16)
    # stop_after_save: an interrupted 8-step run, its schedules (Bop's decay) are the full run's
    recorder = {"stop_after_save": True, "series": {"flips": ("lowbit/flips", -1.0)}}
    return fit_ranks(out, DigitsMLP, data, strategy, max_steps, checkpoint, ckpt_path, recorder=recorder)


def _assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_replicas_identical_and_server_equals_allgather(tmp_path):
    server = _fit(tmp_path / "server", 8, aggregation="server")
    gathered = _fit(tmp_path / "allgather", 8, aggregation="allgather")
    _assert_states_equal(server[0]["state"], server[1]["state"])  # the drift guard ran every 2 steps, too
    _assert_states_equal(server[0]["state"], gathered[0]["state"])
    assert sum(server[0]["flips"]) > 0 and server[0]["flips"] == gathered[1]["flips"]
    assert server[0]["state"]["net.0.codes"].dtype == torch.int8


@pytest.mark.parametrize("fp_kept_fraction", [None, 0.25])
def test_resume_mid_run_is_bit_identical(tmp_path, fp_kept_fraction):
    """Dense fp average, and sparse fp lists whose error-feedback residuals travel in rank 0's checkpoint."""
    full = _fit(tmp_path / "full", 8, fp_kept_fraction=fp_kept_fraction)
    _fit(tmp_path / "first", 8, checkpoint=tmp_path / "step4.ckpt", fp_kept_fraction=fp_kept_fraction)
    resumed = _fit(tmp_path / "resumed", 8, ckpt_path=tmp_path / "step4.ckpt", fp_kept_fraction=fp_kept_fraction)
    if fp_kept_fraction is not None:
        saved = torch.load(tmp_path / "step4.ckpt", weights_only=False)["sparseflip"]["residuals"]
        assert len(saved) == 2 and not torch.equal(saved[0], saved[1])  # each rank's own residual
    _assert_states_equal(full[0]["state"], full[1]["state"])
    for rank in range(2):
        _assert_states_equal(full[rank]["state"], resumed[rank]["state"])
        assert str(full[rank]["optimizer"]) == str(resumed[rank]["optimizer"])


def _fabric_run(fabric: Fabric, out: Path) -> None:
    torch.manual_seed(0)
    model = fabric.setup_module(DigitsMLP().net)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = _dataset().tensors
    rows = slice(16 * fabric.global_rank, 16 * (fabric.global_rank + 1))
    for _ in range(3):
        with fabric.no_backward_sync(model):  # accumulation: no exchange
            fabric.backward(nn.functional.cross_entropy(model(x[rows][:8]), y[rows][:8]))
        fabric.backward(nn.functional.cross_entropy(model(x[rows][8:]), y[rows][8:]))
        optimizer.step()
        optimizer.zero_grad()
    metrics = fabric.strategy.last_metrics
    torch.save({"state": model.state_dict(), "metrics": metrics}, out / f"fabric{fabric.global_rank}.pt")


def test_fabric_accumulates_then_exchanges(tmp_path):
    strategy = FabricSparseFlipStrategy(SparseFlipSettings(flip=FLIP), start_method="spawn")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(_fabric_run, tmp_path)
    ranks = [torch.load(tmp_path / f"fabric{r}.pt", weights_only=False) for r in range(2)]
    _assert_states_equal(ranks[0]["state"], ranks[1]["state"])
    assert ranks[0]["metrics"]["lowbit/flips"] > 0
    assert 0 < ranks[1]["metrics"]["comm/flip_bytes_sent"] < 640 * 4  # a sparse list, not a dense fp32 gradient
