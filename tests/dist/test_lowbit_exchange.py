"""The low-bit sparse flip exchange on 2 and 4 spawned gloo ranks.

One launch per world size runs every check: the parameter-server and the all-gather aggregation give the same flip
set on every rank, replicas trained with it stay bit-identical, every ledger delta equals :func:`exchange_bytes`, and
empty lists (on some or all ranks) go through.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hetero.comm import ByteLedger
from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.sparseflip import CodeLayout, SparseFlipExchange, convert_model, exchange_bytes
from lightning_hetero.sparseflip.fp_sync import SparseGradientAverage
from lightning_hetero.testing import run_distributed

pytestmark = pytest.mark.timeout(180)

STEPS = 6


def _delta(ledger: ByteLedger, before: tuple[int, int]) -> tuple[int, int]:
    totals = ledger.totals()
    return totals.sent - before[0], totals.received - before[1]


def _both(rank: int, world: int, grad: torch.Tensor, codes: torch.Tensor, server: int, **kwargs: Any) -> dict[str, Any]:
    """Run both aggregation modes on the same input; return their flips and ledger checks."""
    ledgers = {"server": ByteLedger(), "allgather": ByteLedger()}
    ex = {
        mode: SparseFlipExchange(codes.numel(), mode=mode, server=server, ledger=ledgers[mode], **kwargs)
        for mode in ledgers
    }
    out = {mode: ex[mode].step(grad, codes) for mode in ex}
    sizes = ex["allgather"].last_message_nbytes  # every rank's list size (all-gather mode sees them all)
    flips_nbytes = ex["server"].last_flips_nbytes
    expected = {
        "server": exchange_bytes(sizes, flips_nbytes, "server", server)[rank],
        "allgather": exchange_bytes(sizes, flips_nbytes, "allgather")[rank],
    }
    measured = {mode: _delta(ledgers[mode], (0, 0)) for mode in ledgers}
    return {
        "server_flips": [t.tolist() for t in out["server"]],
        "allgather_flips": [t.tolist() for t in out["allgather"]],
        "expected": expected,
        "measured": measured,
        "last_bytes": {mode: ex[mode].last_bytes for mode in ex},
        "sizes": sizes,
        "selected": ex["server"].last_selected,
    }


def _exercise(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)  # identical replicas
    model = convert_model(nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3, bias=False)), mode="flip")
    layout = CodeLayout(model)
    for parameter in model.parameters():
        parameter.requires_grad_(False)  # biases stay fixed: only codes move, through the exchange
    data = torch.Generator().manual_seed(1000 + rank)  # different data per rank
    steps = []
    for step in range(STEPS):
        layout.zero_grad()
        x, y = torch.randn(16, 12, generator=data), torch.randint(0, 3, (16,), generator=data)
        nn.functional.cross_entropy(model(x), y).backward()
        grad = layout.flat_grad()
        if rank == 1 and step == 2:
            grad.zero_()  # this rank sends an empty list
        server = step % world  # the server role moves around
        result = _both(rank, world, grad, layout.flat_codes(), server, k=8, density=0.1, encoding="bf16")
        flips = result["server_flips"]
        result["moved"] = layout.apply(torch.tensor(flips[0], dtype=torch.long), torch.tensor(flips[1]))
        steps.append(result)
    checks = {"steps": steps, "codes": layout.flat_codes().tolist()}
    # all lists empty: tau above every |g|
    codes = layout.flat_codes()
    checks["all_empty"] = _both(rank, world, torch.zeros(layout.numel), codes, 0, k=4, tau=1.0)
    # a flat space above 65536 codes: blocked 16-bit indices, sign values, the last rank as server
    big = torch.randn(70_000, generator=torch.Generator().manual_seed(rank))
    big_codes = torch.zeros(70_000, dtype=torch.int8)
    checks["big"] = _both(rank, world, big, big_codes, world - 1, k=50, tau=2.5, encoding="sign")
    return checks


@pytest.fixture(scope="module", params=[2, 4])
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_distributed(_exercise, request.param, timeout=150)


def _cases(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [*result["steps"], result["all_empty"], result["big"]]


def test_server_and_allgather_flips_identical_on_every_rank(results: list[dict[str, Any]]) -> None:
    for case in range(len(_cases(results[0]))):
        reference = _cases(results[0])[case]["server_flips"]
        for result in results:
            assert _cases(result)[case]["server_flips"] == reference
            assert _cases(result)[case]["allgather_flips"] == reference
    assert sum(len(step["server_flips"][0]) for step in results[0]["steps"]) > 0  # something did flip
    assert len(results[0]["big"]["server_flips"][0]) == 50


def test_replicas_stay_bit_identical(results: list[dict[str, Any]]) -> None:
    assert all(result["codes"] == results[0]["codes"] for result in results)
    assert sum(step["moved"] for step in results[0]["steps"]) == sum(
        len(step["server_flips"][0]) for step in results[0]["steps"]
    )


def test_ledger_bytes_equal_analytic_payload(results: list[dict[str, Any]]) -> None:
    for result in results:
        for case in _cases(result):
            assert case["measured"] == case["expected"]
            assert case["last_bytes"] == case["expected"]


def test_empty_lists(results: list[dict[str, Any]]) -> None:
    world = len(results)
    for result in results:
        empty = result["all_empty"]
        assert empty["server_flips"] == [[], []] and empty["sizes"] == [4] * world
        assert result["steps"][2]["sizes"][1] == 4  # rank 1's empty list in a non-empty step
    server = results[0]["all_empty"]["expected"]
    assert server["server"] == (4 * (world - 1), 4 * (world - 1)) and server["allgather"] == (
        4 * (world - 1),
        4 * (world - 1),
    )


HUGE = 3e38  # finite in fp32; two ranks' lists of it sum to Inf


def _outcome(fn: Any) -> Any:
    try:
        result = fn()
        return [t.tolist() for t in result] if isinstance(result, tuple) else result.tolist()
    except PeerPayloadError as error:
        return f"PeerPayloadError(peer={error.peer}, field={error.field}): {error}"


def _overflowing_lists(rank: int, world: int) -> dict[str, Any]:
    """Every rank sends a list finite alone (3e38 at the same index) whose sum over the ranks is Inf."""
    grad = torch.zeros(50)
    grad[7] = HUGE
    out: dict[str, Any] = {}
    for policy in ("raise", "drop"):
        average = SparseGradientAverage(50, 0.1, "fp32", on_bad_payload=policy)
        out[f"fp_{policy}"] = _outcome(lambda average=average: average.average(grad))
        out[f"fp_{policy}_dropped"] = average.dropped_payloads
        for mode in ("server", "allgather"):
            exchange = SparseFlipExchange(50, 4, density=0.1, encoding="fp32", mode=mode, on_bad_payload=policy)
            out[f"{mode}_{policy}"] = _outcome(
                lambda exchange=exchange: exchange.step(grad, torch.zeros(50, dtype=torch.int8))
            )
    return out


def test_lists_finite_alone_that_overflow_together_are_refused_or_dropped_on_every_rank() -> None:
    results = run_distributed(_overflowing_lists, 2, timeout=150)
    for rank, result in enumerate(results):
        assert result["fp_raise"].startswith("PeerPayloadError(peer=0, field=values)"), (rank, result["fp_raise"])
        assert "magnitude 3e+38" in result["fp_raise"]
        assert result["fp_drop"] == [0.0] * 50 and result["fp_drop_dropped"] == 2  # no Inf, no 3e38: both left out
        for mode in ("server", "allgather"):
            assert result[f"{mode}_raise"].startswith("PeerPayloadError"), (rank, mode, result[f"{mode}_raise"])
            assert result[f"{mode}_drop"] == [[], []], (rank, mode, result[f"{mode}_drop"])
