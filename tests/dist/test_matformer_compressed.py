"""``aggregate_gradients(mode="demo")`` on 4 spawned gloo ranks with tiers ``[0, 0, 1, 2]``.

One launch runs every scenario; the module fixture keeps the per-rank results and each test asserts one property with
a known answer: kept_fraction 1 equals ``mean`` (plain and weighted, with NaN in the untrained tails of full-size
gradients, which would poison every result if they were ever encoded); at kept_fraction 1/8 the error feedback conserves
the gradient mass (the steps' results plus a lossless flush of the residual buffers equal the ``mean`` results summed);
every holder of a coordinate gets bit-identical values; each rank's ledger bytes equal the DeMo payload formula,
written out here from the definition; helpers are refused; rank 0 collects every rank's buffers for checkpoints. A
second, 2-rank launch has rank 1 forge what it announces and sends to that collection: rank 0 refuses every forgery
before allocating for it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lightning_hetero import comm
from lightning_hetero.comm import INTER, get_ledger
from lightning_hetero.matformer.aggregate import aggregate_gradients
from lightning_hetero.matformer.compressed import (
    CHECKPOINT_LABEL,
    CompressedExchange,
    demo_bytes_per_step,
    demo_payload_bytes,
)
from lightning_hetero.matformer.helper_ranks import HelperConfig
from lightning_hetero.matformer.layout import widths_for
from lightning_hetero.matformer.region_groups import RegionGroups
from lightning_hetero.matformer.types import FFNParameter
from lightning_hetero.replication.settings import ReplicationSettings
from lightning_hetero.testing import run_distributed
from tests.payload_rule import gather_outcome

pytestmark = pytest.mark.timeout(180)

TIERS = [0, 0, 1, 2]
H, D = 16, 8
OTHER_SHAPES = {"embed": (6, 5), "norm": (7,)}
FFN = [FFNParameter("up.weight", 0, H, 0), FFNParameter("up.bias", 0, H, 0), FFNParameter("down.weight", 1, H, 0)]
FFN_SHAPES = {"up.weight": (H, D), "up.bias": (H,), "down.weight": (D, H)}
WEIGHTS = {0: 1.0, 1: 2.0, 2: 4.0}
STEPS = 4


def _grads(rank: int, step: int, full_size: bool) -> dict[str, torch.Tensor]:
    """Random gradients at this rank's local shapes, or full size with NaN in the neurons it did not train."""
    generator = torch.Generator().manual_seed(100 * rank + step)
    grads = {name: torch.randn(shape, generator=generator) for name, shape in OTHER_SHAPES.items()}
    width = H >> TIERS[rank]
    for param in FFN:
        shape = list(FFN_SHAPES[param.name])
        shape[param.axis] = width
        grad = torch.randn(shape, generator=generator)
        if full_size:
            full = torch.full(FFN_SHAPES[param.name], float("nan"))
            full.narrow(param.axis, 0, width).copy_(grad)
            grad = full
        grads[param.name] = grad
    return grads


def _trained(grads: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    width = H >> TIERS[rank]
    out = {name: grads[name].clone() for name in OTHER_SHAPES}
    out.update({p.name: grads[p.name].narrow(p.axis, 0, width).clone() for p in FFN})
    return out


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    layout = widths_for(TIERS, H)
    groups = RegionGroups(layout)
    out: dict[str, Any] = {"parity": [], "weighted_parity": []}
    # kept_fraction 1 with fp32 values sends every DCT coefficient: the same as mean up to fp32 round-off.
    for weights, key in ((None, "parity"), (WEIGHTS, "weighted_parity")):
        lossless = CompressedExchange(groups, 1.0)
        for step in range(2):
            demo, mean = _grads(rank, step, full_size=True), _grads(rank, step, full_size=True)
            aggregate_gradients(demo, FFN, groups, "demo", weights, exchange=lossless)
            aggregate_gradients(mean, FFN, groups, "mean", weights)
            demo, mean = _trained(demo, rank), _trained(mean, rank)
            out[key].append(max(float((demo[n] - mean[n]).abs().max()) for n in demo))
        out[f"{key}_finite"] = all(bool(torch.isfinite(v).all()) for v in demo.values())
    # kept_fraction 1/8: lossy per step, but what is not sent stays in the buffers.
    exchange = CompressedExchange(groups, 1 / 8)
    summed_demo = {n: torch.zeros_like(g) for n, g in _grads(rank, 0, full_size=False).items()}
    summed_mean = {n: torch.zeros_like(g) for n, g in summed_demo.items()}
    out["payload"], out["calls"], out["results"] = [], [], []
    for step in range(STEPS):
        demo, mean = _grads(rank, step, full_size=False), _grads(rank, step, full_size=False)
        with get_ledger().capture() as seen:
            aggregate_gradients(demo, FFN, groups, "demo", exchange=exchange)
        aggregate_gradients(mean, FFN, groups, "mean")
        records = [r for r in seen.records() if r.label == INTER]
        out["payload"].append(sum(r.payload_bytes for r in records))
        out["calls"].append(len(records))
        out["results"].append(demo)
        for name in summed_demo:
            summed_demo[name] += demo[name]
            summed_mean[name] += mean[name]
    out["step_error"] = max(float((summed_demo[n] - summed_mean[n]).abs().max()) for n in summed_demo)
    # Flush the residuals losslessly: a zero gradient through a kept_fraction-1 exchange holding the buffers.
    flush = CompressedExchange(groups, 1.0)
    flush.load_state_dict(exchange.state_dict())
    zeros = {name: torch.zeros_like(g) for name, g in summed_demo.items()}
    aggregate_gradients(zeros, FFN, groups, "demo", exchange=flush)
    out["conservation"] = max(float((summed_demo[n] + zeros[n] - summed_mean[n]).abs().max()) for n in summed_demo)
    out["flush_residual"] = max(float(e.abs().max()) for e in flush.errors.values())
    out["state"] = exchange.state_dict()
    out["gathered"] = exchange.gather_state(torch.device("cpu"))
    try:  # helpers send zeros for untrained tail neurons: refused
        CompressedExchange(RegionGroups(layout, helpers={2: HelperConfig(0.5)}))
        out["helpers_error"] = None
    except ValueError as error:
        out["helpers_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_worker, 4, timeout=150)


def test_lossless_demo_equals_mean_and_never_reads_untrained_coordinates(results):
    for rank, out in enumerate(results):
        assert max(out["parity"]) < 1e-5 and max(out["weighted_parity"]) < 1e-5, rank
        assert out["parity_finite"] and out["weighted_parity_finite"], rank  # NaN tails never encoded


def test_error_feedback_conserves_the_gradient_mass(results):
    for rank, out in enumerate(results):
        assert out["step_error"] > 1e-2, rank  # 1/8 is lossy step by step...
        assert out["conservation"] < 1e-5, rank  # ...but sent + residual == what mean would have applied
        assert out["flush_residual"] < 1e-5, rank


def test_every_holder_of_a_coordinate_gets_bit_identical_values(results):
    reference = results[0]["results"]
    for rank, out in enumerate(results[1:], start=1):
        width = H >> TIERS[rank]
        for step, grads in enumerate(out["results"]):
            for name, value in grads.items():
                axis = next((p.axis for p in FFN if p.name == name), None)
                expected = reference[step][name] if axis is None else reference[step][name].narrow(axis, 0, width)
                assert torch.equal(value, expected), (rank, step, name)


def _slab_payload(shape: tuple[int, ...], kept_fraction: float, chunk: int = 64) -> int:
    """DeMo bytes of one slab from the definition: 12-bit indices and fp32 values of the top-k per DCT block."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
    block_rows, block_cols = min(chunk, rows), min(chunk, cols)
    blocks = math.ceil(rows / block_rows) * math.ceil(cols / block_cols)
    k = max(1, math.floor(kept_fraction * block_rows * block_cols + 1e-9))
    return math.ceil(blocks * k * 12 / 8) + 4 * blocks * k


def test_ledger_bytes_equal_the_demo_payload_formula(results):
    # Regions of tiers [0, 0, 1, 2] with h = 16: [0, 4) all ranks, [4, 8) ranks 0-2, [8, 16) ranks 0-1.
    regions = [((0, 4), (0, 1, 2, 3)), ((4, 8), (0, 1, 2)), ((8, 16), (0, 1))]
    expected = [0] * 4
    for rank in range(4):
        shapes = list(OTHER_SHAPES.values())
        for (start, stop), members in regions:
            if rank in members:
                for param in FFN:
                    slab = list(FFN_SHAPES[param.name])
                    slab[param.axis] = stop - start
                    shapes.append(tuple(slab))
        expected[rank] = sum(_slab_payload(shape, 1 / 8) for shape in shapes)
    param_shapes = {**OTHER_SHAPES, **FFN_SHAPES}
    layout = widths_for(TIERS, H)
    assert (
        demo_payload_bytes(layout, FFN, param_shapes, replication=ReplicationSettings(kept_fraction=1 / 8)) == expected
    )
    for rank, out in enumerate(results):
        assert out["payload"] == [expected[rank]] * STEPS, rank
        assert out["calls"] == [[3, 3, 2, 1][rank]] * STEPS, rank  # one all-gather per multi-rank bucket
    assert expected[3] < expected[2] < expected[0] == expected[1]  # a tier-2 rank sends far fewer bytes
    sent = demo_bytes_per_step(layout, FFN, param_shapes, replication=ReplicationSettings(kept_fraction=1 / 8))
    assert sent[3] == 3 * expected[3]  # (n - 1) x payload: rank 3 is only in the 4-rank bucket


def test_rank0_collects_every_ranks_error_buffers_and_helpers_are_refused(results):
    gathered = results[0]["gathered"]
    assert [out["gathered"] for out in results[1:]] == [None] * 3
    assert len(gathered) == 4
    for rank, out in enumerate(results):
        assert gathered[rank].keys() == out["state"].keys() and out["state"], rank
        assert all(torch.equal(gathered[rank][key], value) for key, value in out["state"].items()), rank
        assert "helper_fraction=0" in out["helpers_error"], rank
    assert len(results[3]["state"]) == 1 and len(results[0]["state"]) == 3  # one buffer per multi-rank bucket


# ------------------------------------------------------------------------------------- forged checkpoint gather
OWN_KEY = "0,1|float32|8"
FORGERIES = {  # what rank 1 announces (key bytes, values) and then sends (None: nothing)
    "numel 2**31": (len(f'["{OWN_KEY}"]'), 2**31, None),
    "key bytes 2**40": (2**40, 8, None),
    "negative numel": (len(f'["{OWN_KEY}"]'), -8, None),
    "NaN values": (len(f'["{OWN_KEY}"]'), 8, [float("nan")] + [0.0] * 7),
    "honest": (len(f'["{OWN_KEY}"]'), 8, [0.5] * 8),
}


def _forging_worker(rank: int, world_size: int) -> list[Any]:
    exchange = CompressedExchange(RegionGroups(widths_for([0, 0], H)), 1 / 8)
    exchange.load_state_dict({OWN_KEY: torch.zeros(8)})
    out: list[Any] = []
    for key_bytes, numel, values in FORGERIES.values():
        if rank == 1:  # the hostile rank: its own all-gather entry and sends instead of gather_state
            every = torch.empty(4, dtype=torch.int64)
            comm.all_gather_into_tensor(every, torch.tensor([key_bytes, numel]), label=CHECKPOINT_LABEL)
            if values is not None:
                comm.send(torch.tensor(list(f'["{OWN_KEY}"]'.encode()), dtype=torch.uint8), 0, label=CHECKPOINT_LABEL)
                comm.send(torch.tensor(values), 0, label=CHECKPOINT_LABEL)
            continue
        out.append(
            gather_outcome(
                lambda: exchange.gather_state(torch.device("cpu")),
                lambda gathered: {key: value.tolist() for key, value in gathered[1].items()},
            )
        )
    return out


@pytest.mark.timeout(120)
def test_rank0_refuses_forged_error_feedback_sizes_and_values_before_allocating():
    outcome = dict(zip(FORGERIES, run_distributed(_forging_worker, 2, timeout=90)[0], strict=True))
    assert outcome["numel 2**31"][:3] == ("refused", 1, "error_feedback.numel")
    assert "outside [0, 8]" in outcome["numel 2**31"][3]  # rank 0's own buffers hold 8 values
    assert outcome["negative numel"][:3] == ("refused", 1, "error_feedback.numel")
    assert outcome["key bytes 2**40"][:3] == ("refused", 1, "error_feedback.key_bytes")
    assert outcome["NaN values"][:3] == ("refused", 1, "error_feedback.values")
    assert outcome["honest"] == ("accepted", {OWN_KEY: [0.5] * 8})
