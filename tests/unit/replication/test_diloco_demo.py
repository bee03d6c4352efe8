"""DeMo + DiLoCo (``DiLoCoReplicator(outer_kept_fraction=...)``) on one replica: the synchronising step sends the DCT
top-k of the delta, keeps the rest as error feedback, and checkpoints it."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.flexdemo.optim import DecoupledAdamW
from lightning_hetero.replication import DiLoCoReplicator, build_replicator


def _sync_once(replicator: DiLoCoReplicator, param: torch.Tensor, inner_update: torch.Tensor) -> torch.Tensor:
    """One period of H = 1: record the anchor, take an "inner step", synchronise; returns the local pre-sync value."""
    replicator.start_step([(0, param)])
    param.sub_(inner_update)
    local = param.clone()
    replicator.end_step([(0, param)])
    return local


def test_sends_the_dct_top_k_of_the_delta_and_keeps_the_rest() -> None:
    replicator = build_replicator(
        "diloco", sync_every=1, outer_lr=1.0, outer_momentum=0.0, outer_kept_fraction=0.25, outer_chunk=4
    )
    param = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    anchor = param.clone()
    local = _sync_once(replicator, param, torch.randn(8, 12, generator=torch.Generator().manual_seed(1)))
    applied = anchor - param  # outer_lr 1, no momentum: the parameters move by exactly the decoded mean delta
    coefficients = replicator.outer_codec.transform.encode(applied.clone())
    kept = (coefficients.abs() > 1e-5).sum(dim=1)
    assert int(kept.max()) <= 4 and int(kept.min()) >= 1  # k = 16 / 4 coefficients of each 4 x 4 block
    residual = replicator.outer_residuals[0]
    torch.testing.assert_close(residual + applied, anchor - local, atol=1e-5, rtol=0)  # nothing lost
    assert float(residual.abs().sum()) > 0
    # the next period sends part of what this one kept: residual + new delta
    before = residual.clone()
    anchor2 = param.clone()
    _sync_once(replicator, param, torch.zeros_like(param))
    torch.testing.assert_close(replicator.outer_residuals[0] + (anchor2 - param), before, atol=1e-5, rtol=0)


def test_keeping_every_coefficient_equals_plain_diloco() -> None:
    plain = build_replicator("diloco", sync_every=2, outer_lr=0.7, outer_momentum=0.9)
    demo = build_replicator("diloco", sync_every=2, outer_lr=0.7, outer_momentum=0.9, outer_kept_fraction=1.0)
    results = []
    for replicator in (plain, demo):
        param = torch.nn.Parameter(torch.randn(6, 10, generator=torch.Generator().manual_seed(2)))
        optimizer = DecoupledAdamW([param], lr=0.05, replicator=replicator)
        for step in range(6):
            param.grad = torch.randn(6, 10, generator=torch.Generator().manual_seed(10 + step))
            optimizer.step()
        results.append(param.detach().clone())
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=0)


def test_payload_is_the_compressed_delta() -> None:
    shapes = [(64, 64), (64,)]
    dense = build_replicator("diloco", sync_every=4, values="bf16")
    demo = build_replicator("diloco", sync_every=4, values="bf16", outer_kept_fraction=1 / 32, outer_chunk=64)
    assert dense.payload_bytes(shapes) == 2 * (64 * 64 + 64)
    assert demo.payload_bytes(shapes) == build_replicator("demo", 1 / 32, chunk=64, values="bf16").payload_bytes(shapes)
    assert demo.describe()["outer_kept_fraction"] == 1 / 32 and "outer_kept_fraction" not in dense.describe()


def test_residuals_round_trip_through_state_dict() -> None:
    replicator = build_replicator("diloco", sync_every=1, outer_kept_fraction=0.25, outer_chunk=4)
    param = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    _sync_once(replicator, param, torch.randn(8, 8, generator=torch.Generator().manual_seed(4)))
    state = replicator.state_dict()
    restored = build_replicator("diloco", sync_every=1, outer_kept_fraction=0.25, outer_chunk=4)
    restored.load_state_dict(state)
    torch.testing.assert_close(restored.outer_residuals[0], replicator.outer_residuals[0], atol=0, rtol=0)
    assert restored.outer_residuals[0] is not replicator.outer_residuals[0]


def test_bad_outer_options() -> None:
    with pytest.raises(ValueError, match=r"outer_kept_fraction must be a number in \(0, 1\]"):
        build_replicator("diloco", outer_kept_fraction=0.0)
    with pytest.raises(ValueError, match="outer_chunk only applies with outer_kept_fraction"):
        build_replicator("diloco", outer_chunk=32)
    with pytest.raises(ValueError, match="chunk must be an integer"):
        build_replicator("diloco", outer_kept_fraction=1 / 32, outer_chunk=0)
