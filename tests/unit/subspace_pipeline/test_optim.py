"""Training keeps confined weights in span(U): reparam with plain AdamW, projected with SubspaceAdamW."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.subspace_pipeline import (
    ProjectedLinear,
    SubspaceAdamW,
    SubspaceConfig,
    SubspaceEmbedding,
    SubspaceLinear,
    build_stages,
    outside_span_fraction,
)
from tests.unit.subspace_pipeline._tiny import chain_with_messages, relative_error, tiny_model, token_ids

STEPS = 50


def _confined(stages) -> list[tuple[str, torch.Tensor, int]]:
    """(name, dense matrix, axis) of every confined matrix of the stages."""
    found = []
    for stage in stages:
        for name, module in stage.named_modules():
            if isinstance(module, SubspaceLinear | ProjectedLinear):
                found.append((name, module.dense_weight().detach(), 0))
            elif isinstance(module, SubspaceEmbedding):
                found.append((name, module.dense_weight().detach(), 1))
    return found


def _train(mode: str, optimizer_name: str) -> tuple[list, list[float], list]:
    stages = build_stages(tiny_model(), SubspaceConfig(subspace_dim=8, mode=mode), 2, [0, 1])
    params = [p for stage in stages for p in stage.parameters()]
    constrained = {p: axis for stage in stages for p, axis in stage.constrained_parameters().items()}
    if optimizer_name == "subspace":
        optimizer = SubspaceAdamW(params, lr=1e-2, weight_decay=0.1, constrained=constrained)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    ids = token_ids(batch=4, seq=16)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        _, loss, _ = chain_with_messages(stages, ids)
        for stage in stages:
            stage.project_gradients_()
        optimizer.step()
        losses.append(float(loss.detach()))
    return stages, losses, _confined(stages)


@pytest.mark.parametrize(("mode", "optimizer_name"), [("reparam", "adamw"), ("projected", "subspace")])
def test_fifty_steps_stay_in_span_and_learn(mode: str, optimizer_name: str) -> None:
    stages, losses, confined = _train(mode, optimizer_name)
    assert len(confined) == 5  # o_proj + down_proj of layers 0 and 1, and the embedding
    u = stages[0].basis
    for name, matrix, axis in confined:
        assert outside_span_fraction(matrix, u, axis) < 1e-5, name
    assert losses[-1] < 0.5 * losses[0]
    # the boundary is still exact after training
    ids = token_ids(batch=4, seq=16)
    first, last = stages
    hidden = first.run_layers(first.embed(ids))
    rebuilt = last.subspace.decode(first(None, ids), ids)
    assert relative_error(rebuilt, hidden) < 1e-5


def test_plain_adamw_drifts_out_of_span_in_projected_mode() -> None:
    """Negative control: the elementwise denominator rotates columns out of span(U) even with projected gradients."""
    stages, _, confined = _train("projected", "adamw")
    worst = max(outside_span_fraction(matrix, stages[0].basis, axis) for _, matrix, axis in confined)
    assert worst > 1e-2


def test_subspace_adamw_is_adamw_on_unconstrained_parameters() -> None:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    twin = torch.nn.Parameter(weight.detach().clone())
    ours = SubspaceAdamW([weight], lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    reference = torch.optim.AdamW([twin], lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    data = torch.randn(7, 5, dtype=torch.float64)
    for _ in range(10):
        for parameter, optimizer in ((weight, ours), (twin, reference)):
            optimizer.zero_grad()
            (data @ parameter).sin().sum().backward()
            optimizer.step()
    torch.testing.assert_close(weight, twin, rtol=1e-12, atol=1e-12)


def test_shared_second_moment_shape_and_errors() -> None:
    weight = torch.nn.Parameter(torch.randn(6, 4))
    table = torch.nn.Parameter(torch.randn(9, 6))
    optimizer = SubspaceAdamW([weight, table], constrained={weight: 0, table: 1})
    (weight.sum() + table.square().sum()).backward()
    optimizer.step()
    assert optimizer.state[weight]["exp_avg_sq"].shape == (1, 4)
    assert optimizer.state[table]["exp_avg_sq"].shape == (9, 1)
    with pytest.raises(ValueError, match="not among the optimized params"):
        SubspaceAdamW([weight], constrained={table: 1})
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        SubspaceAdamW([weight], constrained={weight: 2})
