"""Subspace (Grassmann) updates: the gradient sketch, propose_basis + rebase_, exactness afterwards."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.subspace_pipeline import (
    SubspaceAdamW,
    SubspaceConfig,
    build_stages,
    constrained_model,
    orthonormal_basis,
    outside_span_fraction,
    propose_basis,
    reference_forward,
)
from tests.unit.subspace_pipeline._tiny import chain_with_messages, fresh, relative_error, tiny_model, token_ids
from tests.unit.subspace_pipeline.test_optim import _confined


def _boundary_gradient(stages, ids) -> torch.Tensor:
    """dL/dh (d-dim) at the input of the last stage, computed without the sketch hooks."""
    first, last = stages
    for stage in stages:
        stage.track_subspace_gradient(False)
    residual = last.subspace.decode(first(None, ids).detach(), ids).detach().requires_grad_(True)
    logits = last.lm_head(last.model.norm(last.run_layers(residual)))
    from lightning_hetero.subspace_pipeline import causal_lm_loss

    (grad,) = torch.autograd.grad(causal_lm_loss(logits, ids), residual)
    for stage in stages:
        stage.track_subspace_gradient(True)
    return grad.reshape(-1, grad.shape[-1])


@pytest.mark.parametrize("mode", ["reparam", "projected"])
def test_sketch_is_the_boundary_gradient_energy_and_sums_over_stages(mode: str) -> None:
    model = tiny_model()
    config = SubspaceConfig(subspace_dim=8, mode=mode, update_every=10)
    stages = build_stages(fresh(model), config, 2, [0, 1])
    whole = constrained_model(fresh(model), config, 2)
    ids = token_ids()
    for _ in range(2):  # two micro-batches before the step's commit
        chain_with_messages(stages, ids)
    from lightning_hetero.subspace_pipeline import causal_lm_loss

    causal_lm_loss(reference_forward(whole, ids), ids).backward()
    for module in (*stages, whole):
        module.accumulate_subspace_gradient_()
    g = _boundary_gradient(stages, ids)
    expected = 2 * g.T @ (g @ stages[1].basis)
    assert torch.count_nonzero(stages[0].subspace_statistic) == 0  # the first stage has no input boundary
    assert relative_error(stages[1].subspace_statistic, expected) < 1e-5
    total = stages[0].subspace_statistic + stages[1].subspace_statistic  # what the runtime's all-reduce forms
    assert relative_error(whole.subspace_statistic, expected / 2) < 1e-5
    assert relative_error(total, expected) < 1e-5
    # nothing is recorded when tracking is off (update_every=0)
    frozen = build_stages(fresh(model), SubspaceConfig(subspace_dim=8, mode=mode), 2, [0, 1])
    chain_with_messages(frozen, ids)
    frozen[1].accumulate_subspace_gradient_()
    assert torch.count_nonzero(frozen[1].subspace_statistic) == 0


@pytest.mark.parametrize("mode", ["reparam", "projected"])
def test_rebase_within_the_same_span_keeps_the_function_and_rotates_moments(mode: str) -> None:
    stages = build_stages(tiny_model(), SubspaceConfig(subspace_dim=8, mode=mode), 2, [0, 1])
    params = [p for s in stages for p in s.parameters()]
    constrained = {p: a for s in stages for p, a in s.constrained_parameters().items()}
    optimizer = SubspaceAdamW(params, lr=1e-2, constrained=constrained)
    ids = token_ids()
    for _ in range(3):
        optimizer.zero_grad()
        chain_with_messages(stages, ids)
        for stage in stages:
            stage.project_gradients_()
        optimizer.step()
    before = reference_forward(stages, ids).detach()
    rotation = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(4))).Q
    new_basis = stages[0].basis @ rotation  # another basis of the same subspace
    down = stages[0].model.layers["0"].mlp.down_proj
    weight = down.weight_coords if mode == "reparam" else down.weight
    moment = optimizer.state[weight]["exp_avg"].clone()
    for stage in stages:
        stage.rebase_(new_basis, optimizer)
    assert relative_error(reference_forward(stages, ids), before) < 1e-5
    expected = rotation.T @ moment if mode == "reparam" else moment  # R = U_new^T U_old = Q^T; P is unchanged
    torch.testing.assert_close(optimizer.state[weight]["exp_avg"], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["reparam", "projected"])
def test_after_a_grassmann_update_reconstruction_is_exact_and_training_stays_in_span(mode: str) -> None:
    model = tiny_model()
    config = SubspaceConfig(subspace_dim=8, mode=mode, update_every=5, update_lr=0.3)
    stages = build_stages(fresh(model), config, 2, [0, 1])
    params = [p for s in stages for p in s.parameters()]
    constrained = {p: a for s in stages for p, a in s.constrained_parameters().items()}
    optimizer = SubspaceAdamW(params, lr=1e-2, weight_decay=0.1, constrained=constrained)
    ids = token_ids(batch=4, seq=16)

    def train(steps: int) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            chain_with_messages(stages, ids)
            for stage in stages:
                stage.accumulate_subspace_gradient_()
                stage.project_gradients_()
            optimizer.step()

    train(5)
    old = stages[0].basis.clone()
    statistic = sum(stage.subspace_statistic for stage in stages)
    new_basis = propose_basis(old, statistic, config.update_lr)
    for stage in stages:
        stage.rebase_(new_basis, optimizer)
        assert torch.count_nonzero(stage.subspace_statistic) == 0
    angle = torch.linalg.svdvals(old.double().T @ stages[1].basis.double()).clamp(max=1).acos().max()
    assert angle > 0.05  # the subspace really moved
    for name, matrix, axis in _confined(stages):
        assert outside_span_fraction(matrix, new_basis, axis) < 1e-5, name
    first, last = stages
    hidden = first.run_layers(first.embed(ids)).detach()
    assert relative_error(last.subspace.decode(first(None, ids), ids), hidden) < 1e-5
    train(10)  # moments were re-expressed: training continues inside the new span
    for name, matrix, axis in _confined(stages):
        assert outside_span_fraction(matrix, new_basis, axis) < 1e-5, name


def test_chained_and_whole_model_agree_after_the_same_rebase() -> None:
    model = tiny_model(dtype=torch.float64)
    config = SubspaceConfig(subspace_dim=8)
    stages = build_stages(fresh(model), config, 4, [0, 1, 2, 3])
    whole = constrained_model(fresh(model), config, 4)
    new_basis = orthonormal_basis(64, 8, seed=99, dtype=torch.float64)
    for module in (*stages, whole):
        module.rebase_(new_basis)
    ids = token_ids()
    assert relative_error(reference_forward(stages, ids), reference_forward(whole, ids)) < 1e-6


def test_rebase_rejects_bad_input() -> None:
    (stage,) = build_stages(tiny_model(), SubspaceConfig(subspace_dim=8), 2, [0])
    with pytest.raises(ValueError, match="expected"):
        stage.rebase_(torch.zeros(64, 4))
    (plain,) = build_stages(tiny_model(), SubspaceConfig(compress=False), 2, [0])
    with pytest.raises(ValueError, match="compress"):
        plain.rebase_(torch.zeros(64, 8))
