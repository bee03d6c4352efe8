"""Per-region MatFormer gradient aggregation on 4 and 2 spawned gloo ranks: known answers, a dense reference,
DDP parity (one step and ten SGD steps) and each rank's exact ledger bytes against the analytic formula.

One launch per world size runs every scenario (spawning costs seconds on this box); the module fixtures keep the
results and each test asserts one family of them. The dense reference below is written from the definition: pad
every rank's contribution to full width with a mask of the neurons it trained, then average (or vote) per neuron.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hetero import comm
from lightning_hetero.comm import ByteLedger
from lightning_hetero.matformer.aggregate import aggregate_gradients
from lightning_hetero.matformer.helper_ranks import HelperConfig, helper_neurons, trained_neurons
from lightning_hetero.matformer.layout import widths_for
from lightning_hetero.matformer.region_groups import RegionGroups
from lightning_hetero.matformer.tiers import bucket_numels, bytes_per_step
from lightning_hetero.matformer.types import FFNParameter
from lightning_hetero.testing import run_distributed

pytestmark = pytest.mark.timeout(180)

H, D = 8, 3
OTHER_SHAPES = {"embed": (5, 2), "norm": (3,)}
WEIGHTS = {0: 1.0, 1: 2.0, 2: 4.0}
HELPERS = {2: HelperConfig(0.5, seed=1, redraw_every=2), 3: HelperConfig(1.0, seed=2, redraw_every=1)}

# name, tiers per rank (int or one per layer), layers, mode, tier_weights, helpers, ranks passing full-size grads
SCENARIOS_4: list[tuple[str, list[Any], int, str, Any, Any, tuple[int, ...]]] = [
    ("mean", [0, 0, 1, 2], 1, "mean", None, None, ()),
    ("mean_full_size_grads", [0, 0, 1, 2], 1, "mean", None, None, (2, 3)),
    ("sign", [0, 0, 1, 2], 1, "sign", None, None, ()),
    ("weighted_mean", [0, 0, 1, 2], 1, "mean", WEIGHTS, None, ()),
    ("weighted_sign", [0, 0, 1, 2], 1, "sign", WEIGHTS, None, ()),
    ("per_layer_mean", [[0, 1], [1, 0], [2, 2], [0, 2]], 2, "mean", None, None, ()),
    ("per_layer_weighted_sign", [[0, 1], [1, 0], [2, 2], [0, 2]], 2, "sign", WEIGHTS, None, ()),
    ("helpers_mean", [0, 0, 1, 2], 1, "mean", None, HELPERS, (3,)),
    ("helpers_weighted_mean", [0, 0, 1, 2], 1, "mean", WEIGHTS, HELPERS, (3,)),
    ("helpers_sign", [0, 0, 1, 2], 1, "sign", None, HELPERS, (3,)),
    ("helpers_no_tier0_mean", [1, 1, 2, 2], 1, "mean", None, HELPERS, (3,)),
]
STEPS = (0, 1, 2)  # crosses helper re-draws (rank 3 every step, rank 2 every second step)


def _ffn_params(layers: int) -> tuple[list[FFNParameter], dict[str, tuple[int, ...]]]:
    ffn, shapes = [], dict(OTHER_SHAPES)
    for layer in range(layers):
        for proj, shape, axis in (("up.weight", (H, D), 0), ("up.bias", (H,), 0), ("down.weight", (D, H), 1)):
            ffn.append(FFNParameter(f"l{layer}.{proj}", axis, H, layer))
            shapes[f"l{layer}.{proj}"] = shape
    return ffn, shapes


def _trained(tiers: list[Any], rank: int, layer: int, helpers: Any, step: int) -> list[int]:
    """Neurons ``rank`` trains, from the definition: prefix ``H >> tier`` plus its helper draw (if any)."""
    tier = tiers[rank] if isinstance(tiers[rank], int) else tiers[rank][layer]
    width = H >> tier
    config = (helpers or {}).get(rank)
    drawn = []
    if config is not None and width < H:
        drawn = helper_neurons(width, H, config.fraction, config.seed, step, config.redraw_every, layer=layer).tolist()
    return list(range(width)) + drawn


def _local_grads(index: int, rank: int, step: int, scenario: tuple) -> dict[str, torch.Tensor]:
    """Random gradients at this rank's local (or full) shapes; a third of the values are exact zeros."""
    name, tiers, layers, mode, _, helpers, full_ranks = scenario
    generator = torch.Generator().manual_seed(1000 * index + 10 * rank + step)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        values = torch.randint(-1, 2, shape, generator=generator).float()
        return values * (torch.rand(shape, generator=generator) + 0.5)

    ffn, shapes = _ffn_params(layers)
    grads = {other: draw(shape) for other, shape in OTHER_SHAPES.items()}
    for param in ffn:
        trained = _trained(tiers, rank, param.layer, helpers, step)
        shape = list(shapes[param.name])
        if rank in full_ranks:  # full-size grads: untrained neurons hold garbage that must be ignored
            grad = torch.full(shape, 100.0 + rank)
            grad.index_copy_(param.axis, torch.tensor(trained), draw(_with(shape, param.axis, len(trained))))
        else:
            grad = draw(_with(shape, param.axis, len(trained)))
        grads[param.name] = grad
    return grads


def _with(shape: list[int], axis: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[axis] = size
    return tuple(out)


# ------------------------------------------------------------------------------------------------ child process
def _run_scenarios(rank: int, world_size: int, scenarios: list[tuple]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    built: dict[str, RegionGroups] = {}  # scenarios with the same layout and helpers share their groups
    for index, scenario in enumerate(scenarios):
        name, tiers, layers, mode, weights, helpers, _ = scenario
        ffn, _ = _ffn_params(layers)
        key = repr((tiers, layers, helpers))
        if key not in built:
            layout = widths_for(tiers, H, num_layers=layers if layers > 1 else None)
            built[key] = RegionGroups(layout, helpers=helpers)
        groups = built[key]
        for step in STEPS:
            grads = _local_grads(index, rank, step, scenario)
            inputs = {key: value.clone() for key, value in grads.items()}
            ledger = ByteLedger()
            aggregate_gradients(grads, ffn, groups, mode, weights, step=step, ledger=ledger)
            out[f"{name}/{step}"] = (inputs, grads, ledger.totals("inter"), ledger.labels())
    return out


def _known_answers(rank: int, world_size: int) -> dict[str, Any]:
    """Rank i's gradient is i + 1 everywhere: every region's mean is the mean of its ranks' i + 1."""
    tiers = [0, 0, 1, 2][:world_size] if world_size == 4 else [0, 1]
    layout = widths_for(tiers, H)
    ffn, shapes = _ffn_params(1)
    groups = RegionGroups(layout, label="wan")
    out = {}
    for mode, weights in (("mean", None), ("mean", WEIGHTS)):
        grads = {name: torch.full(shape, rank + 1.0) for name, shape in OTHER_SHAPES.items()}
        for param in ffn:
            grads[param.name] = torch.full(_with(list(shapes[param.name]), param.axis, layout.width(rank)), rank + 1.0)
        ledger = ByteLedger()
        aggregate_gradients(grads, ffn, groups, mode, weights, ledger=ledger)
        out[f"{mode}/{weights is not None}"] = (grads, ledger.totals("wan"), ledger.labels())
    # sign, one vote per rank: row 0 ties (0), row 1 is -1, rows 2-3 +1, and the tail rows [4, 8), which only
    # tier-0 ranks hold and where every gradient is exactly 0, must stay 0 (never +1).
    grads = {"l0.up.weight": torch.zeros(layout.width(rank), D)}
    grads["l0.up.weight"][0] = 1.0 if rank % 2 == 0 else -1.0
    grads["l0.up.weight"][1] = -2.0
    grads["l0.up.weight"][2:4] = 0.5
    aggregate_gradients(grads, ffn[:1], groups, "sign")
    out["sign_zeros"] = grads["l0.up.weight"]
    return out


def _ddp_parity(rank: int, world_size: int) -> dict[str, Any]:
    """All ranks tier 0: one step equals a plain all-reduce mean; ten SGD steps equal DDP-style averaging."""
    layout = widths_for([0] * world_size, H)
    groups = RegionGroups(layout)
    ffn = [FFNParameter("0.weight", 0, H, 0), FFNParameter("0.bias", 0, H, 0), FFNParameter("2.weight", 1, H, 0)]
    generator = torch.Generator().manual_seed(rank)
    grads = {"a": torch.randn(4, 8, generator=generator), "0.weight": torch.randn(H, 4, generator=generator)}
    ffn_one = ffn[:1]
    reference = {name: grad.clone() for name, grad in grads.items()}
    for grad in reference.values():
        comm.all_reduce(grad, "avg", label="ref", ledger=ByteLedger())
    ledger = ByteLedger()
    aggregate_gradients(grads, ffn_one, groups, ledger=ledger)
    one_step = max((grads[name] - reference[name]).abs().max().item() for name in grads)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, H), nn.ReLU(), nn.Linear(H, 3))

    tiered, plain = model(), model()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tiered, plain)]
    for step in range(10):
        data = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 4, generator=data), torch.randn(6, 3, generator=data)
        for net, optimizer in zip((tiered, plain), optimizers, strict=True):
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
        aggregate_gradients({n: p.grad for n, p in tiered.named_parameters()}, ffn, groups, step=step)
        for param in plain.parameters():
            comm.all_reduce(param.grad, "avg", label="ref", ledger=ByteLedger())
        for optimizer in optimizers:
            optimizer.step()
    params = {name: p.detach().clone() for name, p in tiered.named_parameters()}
    ten_steps = max((p - q).abs().max().item() for p, q in zip(tiered.parameters(), plain.parameters(), strict=True))
    return {"one_step": one_step, "calls": ledger.totals("inter").calls, "ten_steps": ten_steps, "params": params}


def _all_4(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "scenarios": _run_scenarios(rank, world_size, SCENARIOS_4),
        "known": _known_answers(rank, world_size),
        "ddp": _ddp_parity(rank, world_size),
    }


SCENARIOS_2 = [
    ("mean", [0, 1], 1, "mean", None, None, ()),
    ("sign", [0, 1], 1, "sign", None, None, ()),
    ("helpers_mean", [0, 1], 1, "mean", None, {1: HelperConfig(0.5, seed=4, redraw_every=1)}, ()),
]


def _all_2(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "scenarios": _run_scenarios(rank, world_size, SCENARIOS_2),
        "known": _known_answers(rank, world_size),
        "ddp": _ddp_parity(rank, world_size),
    }


# ------------------------------------------------------------------------------------------------ parent side
@pytest.fixture(scope="module")
def results_4() -> list[dict[str, Any]]:
    return run_distributed(_all_4, 4, timeout=150)


@pytest.fixture(scope="module")
def results_2() -> list[dict[str, Any]]:
    return run_distributed(_all_2, 2, timeout=90)


def _tier(tiers: list[Any], rank: int, layer: int) -> int:
    return tiers[rank] if isinstance(tiers[rank], int) else tiers[rank][layer]


def _expected(scenario: tuple, step: int, inputs: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The dense reference: every rank's contribution padded to full width with a mask of what it trained."""
    _, tiers, layers, mode, weights, helpers, full_ranks = scenario
    world = len(inputs)

    def weight(rank: int, layer: int | None) -> float:
        if weights is None:
            return 1.0
        return weights[min(_tier(tiers, rank, i) for i in (range(layers) if layer is None else [layer]))]

    def combine(contributions: list[tuple[float, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if mode == "sign":
            return torch.sign(sum(w * torch.sign(value) * mask for w, value, mask in contributions))
        total = sum(w * value * mask for w, value, mask in contributions)
        count = sum(w * mask for w, _, mask in contributions)
        return torch.where(count > 0, total / torch.where(count > 0, count, 1.0), 0.0)

    expected: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for name in OTHER_SHAPES:
        value = combine([(weight(r, None), inputs[r][name], torch.tensor(1.0)) for r in range(world)])
        for rank in range(world):
            expected[rank][name] = value
    ffn, shapes = _ffn_params(layers)
    for param in ffn:
        contributions = []
        for rank in range(world):
            trained = torch.tensor(_trained(tiers, rank, param.layer, helpers, step))
            local = inputs[rank][param.name]
            if rank in full_ranks:
                local = local.index_select(param.axis, trained)
            padded = torch.zeros(shapes[param.name]).index_copy_(param.axis, trained, local)
            mask = torch.zeros(shapes[param.name]).index_fill_(param.axis, trained, 1.0)
            contributions.append((weight(rank, param.layer), padded, mask))
        value = combine(contributions)
        for rank in range(world):
            trained = torch.tensor(_trained(tiers, rank, param.layer, helpers, step))
            if rank not in full_ranks:
                expected[rank][param.name] = value.index_select(param.axis, trained)
                continue
            width = H >> _tier(tiers, rank, param.layer)
            helper = rank in (helpers or {}) and width < H
            synced = torch.arange(H if helper else width)  # a full-size helper keeps its whole tail in sync
            out = inputs[rank][param.name].clone()  # coordinates it does not exchange stay as they were
            expected[rank][param.name] = out.index_copy_(param.axis, synced, value.index_select(param.axis, synced))
    return expected


def _check_scenarios(results: list[dict[str, Any]], scenarios: list[tuple]) -> None:
    for scenario in scenarios:
        for step in STEPS:
            key = f"{scenario[0]}/{step}"
            inputs = [result["scenarios"][key][0] for result in results]
            for rank, expected in enumerate(_expected(scenario, step, inputs)):
                outputs = results[rank]["scenarios"][key][1]
                assert outputs.keys() == expected.keys()
                for name, value in expected.items():
                    assert outputs[name].shape == value.shape, (key, rank, name)
                    torch.testing.assert_close(outputs[name], value, rtol=0, atol=1e-6, msg=f"{key} rank {rank} {name}")
                    if scenario[3] == "sign":
                        assert set(outputs[name].unique().tolist()) <= {-1.0, 0.0, 1.0}, (key, rank, name)


def _check_ledger(results: list[dict[str, Any]], scenarios: list[tuple]) -> None:
    for scenario in scenarios:
        name, tiers, layers, mode, weights, helpers, _ = scenario
        layout = widths_for(tiers, H, num_layers=layers if layers > 1 else None)
        ffn, shapes = _ffn_params(layers)
        kwargs = {"mode": mode, "tier_weights": weights, "helpers": helpers}
        analytic = bytes_per_step(layout, ffn, shapes, **kwargs)
        buckets = bucket_numels(layout, ffn, shapes, **kwargs)
        for rank, result in enumerate(results):
            calls = sum(1 for members, _ in buckets if rank in members and len(members) > 1)
            for step in STEPS:
                _, _, totals, labels = result["scenarios"][f"{name}/{step}"]
                assert (totals.sent, totals.received, totals.calls) == (analytic[rank], analytic[rank], calls), (
                    name,
                    step,
                    rank,
                )
                assert labels == (["inter"] if calls else [])


def test_scenarios_match_the_dense_reference_on_4_ranks(results_4: list[dict[str, Any]]) -> None:
    _check_scenarios(results_4, SCENARIOS_4)


def test_scenarios_match_the_dense_reference_on_2_ranks(results_2: list[dict[str, Any]]) -> None:
    _check_scenarios(results_2, SCENARIOS_2)


def test_ledger_bytes_per_rank_equal_the_analytic_formula(
    results_4: list[dict[str, Any]], results_2: list[dict[str, Any]]
) -> None:
    _check_ledger(results_4, SCENARIOS_4)
    _check_ledger(results_2, SCENARIOS_2)
    # A tier-2 rank sends only its prefix: in the plain 4-rank mean scenario, 2 of 8 neurons (+ non-FFN grads).
    ffn, shapes = _ffn_params(1)
    per_neuron = 2 * D + 1
    tier2 = 2 * 3 * 4 * (2 * per_neuron + 13) // 4
    assert results_4[3]["scenarios"]["mean/0"][2].sent == tier2


def _regions_of(tensor: torch.Tensor, axis: int, bounds: list[int]) -> list[list[float]]:
    return [tensor.narrow(axis, a, b - a).unique().tolist() for a, b in zip(bounds, bounds[1:], strict=False)]


def test_known_per_region_means_4_ranks(results_4: list[dict[str, Any]]) -> None:
    # widths 8, 8, 4, 2; rank i sends i + 1: [0, 2) -> mean(1..4), [2, 4) -> mean(1..3), [4, 8) -> mean(1, 2).
    plain = [2.5, 2.0, 1.5]
    weighted = [25 / 8, 9 / 4, 1.5]  # weights 1, 1, 2, 4 by tier: (1 + 2 + 2*3 + 4*4) / 8, (1 + 2 + 2*3) / 4
    bounds = [0, 2, 4, 8]
    for rank, result in enumerate(results_4):
        width = [8, 8, 4, 2][rank]
        regions_held = len([b for b in bounds[1:] if b <= width])
        for key, values, other in (("mean/False", plain, 2.5), ("mean/True", weighted, 25 / 8)):
            grads, totals, labels = result["known"][key]
            assert labels == ["wan"]
            assert grads["embed"].unique().tolist() == pytest.approx([other])
            for name, axis in (("l0.up.weight", 0), ("l0.up.bias", 0), ("l0.down.weight", 1)):
                got = _regions_of(grads[name], axis, bounds[: regions_held + 1])
                assert got == [[pytest.approx(v)] for v in values[:regions_held]], (rank, key, name)


def test_known_per_region_means_2_ranks(results_2: list[dict[str, Any]]) -> None:
    # widths 8, 4; [0, 4) -> mean(1, 2) = 1.5, [4, 8) -> rank 0 alone = 1; weighted (1*1 + 2*2) / 3.
    for rank, result in enumerate(results_2):
        grads, _, _ = result["known"]["mean/False"]
        assert grads["l0.up.weight"][:4].unique().tolist() == [1.5] and grads["embed"].unique().tolist() == [1.5]
        assert rank == 1 or grads["l0.up.weight"][4:].unique().tolist() == [1.0]
        grads, _, _ = result["known"]["mean/True"]
        assert grads["l0.down.weight"][:, :4].unique().tolist() == pytest.approx([5 / 3])
        assert grads["norm"].unique().tolist() == pytest.approx([5 / 3])


def test_sign_never_turns_an_untrained_zero_into_plus_one(
    results_4: list[dict[str, Any]], results_2: list[dict[str, Any]]
) -> None:
    expected = torch.tensor([0.0, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])[:, None].expand(H, D)
    for results, widths in ((results_4, [8, 8, 4, 2]), (results_2, [8, 4])):
        for rank, result in enumerate(results):
            assert torch.equal(result["known"]["sign_zeros"], expected[: widths[rank]]), rank


def test_all_tier_0_equals_plain_all_reduce_mean_and_ten_sgd_steps(
    results_4: list[dict[str, Any]], results_2: list[dict[str, Any]]
) -> None:
    for results in (results_4, results_2):
        for result in results:
            ddp = result["ddp"]
            assert ddp["one_step"] < 1e-6 and ddp["calls"] == 1  # one bucket: FFN prefix + non-FFN together
            assert ddp["ten_steps"] < 1e-6
        first = results[0]["ddp"]["params"]
        for result in results[1:]:
            for name, value in result["ddp"]["params"].items():
                assert torch.equal(value, first[name]), name  # replicas stay identical


def test_trained_neurons_agree_with_the_reference_definition() -> None:
    layout = widths_for([0, 0, 1, 2], H)
    for rank in range(4):
        for step in STEPS:
            assert trained_neurons(layout, rank, helpers=HELPERS, step=step).tolist() == _trained(
                [0, 0, 1, 2], rank, 0, HELPERS, step
            )
