"""U, T_fixed and the Grassmann step."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.subspace_pipeline import FixedTokenTable, orthonormal_basis, outside_span_fraction, propose_basis


def test_basis_is_orthonormal_seeded_and_dtype_independent(device: torch.device) -> None:
    u = orthonormal_basis(64, 8, seed=3, dtype=torch.float64, device=device)
    assert u.device == device
    torch.testing.assert_close(u.T @ u, torch.eye(8, dtype=torch.float64, device=device))
    assert torch.equal(u.cpu(), orthonormal_basis(64, 8, seed=3, dtype=torch.float64))  # drawn on the CPU: the same
    assert not torch.equal(u, orthonormal_basis(64, 8, seed=4, dtype=torch.float64, device=device))
    assert torch.equal(orthonormal_basis(64, 8, seed=3, device=device), u.float())
    with pytest.raises(ValueError, match="rank=65"):
        orthonormal_basis(64, 65, seed=0)


def test_fixed_table_same_values_materialized_or_on_demand(device: torch.device) -> None:
    stored = FixedTokenTable(100, 32, seed=5, std=0.5, materialize=True).to(device)
    lazy = FixedTokenTable(100, 32, seed=5, std=0.5, materialize=False).to(device)
    assert stored.table is not None and lazy.table is None
    ids = torch.tensor([[0, 99, 7], [7, 7, 1]], device=device)
    rows = stored(ids)
    assert rows.device == device and torch.equal(rows, lazy(ids))
    assert torch.equal(stored.full(), lazy.full())
    full = stored.full(torch.float64)
    assert abs(float(full.std()) - 0.5) < 0.02 and abs(float(full.mean())) < 0.02
    assert torch.linalg.matrix_rank(full) == 32  # full rank
    assert not torch.equal(full, FixedTokenTable(100, 32, seed=6, std=0.5).full(torch.float64))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 100\)"):
        stored(torch.tensor([100]))


def test_fixed_table_extra_state_restores_seed() -> None:
    source = FixedTokenTable(50, 16, seed=11, std=1.0)
    target = FixedTokenTable(50, 16, seed=0, std=0.02)
    target.load_state_dict(source.state_dict())
    assert torch.equal(target.full(), source.full())
    with pytest.raises(ValueError, match="another model"):
        FixedTokenTable(51, 16, seed=0, std=1.0).load_state_dict(source.state_dict())


def test_propose_basis_moves_towards_dominant_gradient_directions(device: torch.device) -> None:
    generator = torch.Generator().manual_seed(123)
    u = orthonormal_basis(32, 4, seed=0, dtype=torch.float64, device=device)
    directions = torch.linalg.qr(torch.randn(32, 4, generator=generator, dtype=torch.float64)).Q.to(device)
    weights = torch.diag(torch.tensor([1.0, 0.9, 0.8, 0.7], dtype=torch.float64, device=device))
    gradients = directions @ weights  # C = G G^T
    before = outside_span_fraction(directions, u)
    energy = float((gradients.T @ u).square().sum())
    for _ in range(100):
        u = propose_basis(u, gradients @ (gradients.T @ u), lr=1.0)
        assert u.device == device
        torch.testing.assert_close(u.T @ u, torch.eye(4, dtype=torch.float64, device=device))
        new_energy = float((gradients.T @ u).square().sum())  # captured gradient energy never decreases
        assert new_energy >= energy - 1e-12
        energy = new_energy
    assert before > 0.9 and outside_span_fraction(directions, u) < 1e-3


def test_propose_basis_small_step_and_edge_cases() -> None:
    u = orthonormal_basis(16, 3, seed=1)
    statistic = torch.randn(16, 3, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(propose_basis(u, statistic, lr=1e-9), u, atol=1e-6)  # sign-fixed QR: no flips
    assert torch.equal(propose_basis(u, torch.zeros(16, 3), lr=0.5), u)
    moved = propose_basis(u, statistic, lr=0.1)
    angles = torch.linalg.svdvals(u.double().T @ moved.double()).clamp(max=1).acos()
    assert 0 < float(angles.max()) <= float(torch.atan(torch.tensor(0.1))) + 1e-6  # lr bounds the rotation
    with pytest.raises(ValueError, match="shape"):
        propose_basis(u, torch.zeros(16, 4), lr=0.1)
