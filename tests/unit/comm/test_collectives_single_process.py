"""Counted collectives in one process: without a process group, and on a real 1-rank gloo group (0 wire bytes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_hetero import comm
from lightning_hetero.comm import INTER, INTRA, ByteLedger, LedgerTotals
from lightning_hetero.testing import find_free_port

BITCAST_DTYPES = [torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(params=["uninitialized", "gloo-world-1"])
def world_of_one(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both ways a single process can run the wrappers; the repo conftest destroys the group afterwards."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if request.param == "gloo-world-1":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    yield request.param
    if dist.is_initialized():
        dist.destroy_process_group()


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _pattern(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (fp8 included), deterministic."""
    size = torch.empty(0, dtype=dtype).element_size()
    return (torch.arange(numel * size, dtype=torch.int64) * 37 + 11).remainder(251).to(torch.uint8).view(dtype)


def test_world_of_one_values_and_zero_bytes(world_of_one: str) -> None:
    ledger = ByteLedger()
    x = torch.tensor([1.0, 2.0, 3.0])
    comm.all_reduce(x, "avg", label=INTER, ledger=ledger)
    assert x.tolist() == [1.0, 2.0, 3.0]
    handle = comm.all_reduce(x, "sum", label=INTER, ledger=ledger, async_op=True)
    handle.wait()
    assert x.tolist() == [1.0, 2.0, 3.0]

    small = torch.tensor([-7, 300], dtype=torch.int16)
    comm.all_reduce(small, "max", label=INTRA, ledger=ledger)
    assert small.tolist() == [-7, 300]

    for dtype in BITCAST_DTYPES:
        source = _pattern(dtype, 5)
        gathered = torch.empty(5, dtype=dtype)
        comm.all_gather_into_tensor(gathered, source, label=INTER, ledger=ledger)
        assert _raw(gathered) == _raw(source), dtype
        as_list = [torch.empty(5, dtype=dtype)]
        comm.all_gather(as_list, source, label=INTER, ledger=ledger)
        assert _raw(as_list[0]) == _raw(source), dtype
        shared = source.clone()
        comm.broadcast(shared, 0, label=INTER, ledger=ledger)
        assert _raw(shared) == _raw(source), dtype
        exchanged = torch.empty(5, dtype=dtype)
        comm.all_to_all_single(exchanged, source, label=INTER, ledger=ledger)
        assert _raw(exchanged) == _raw(source), dtype

    scattered = torch.empty(4)
    comm.reduce_scatter_tensor(scattered, torch.arange(4.0), "avg", label=INTRA, ledger=ledger)
    assert scattered.tolist() == [0.0, 1.0, 2.0, 3.0]
    comm.barrier()

    assert all(r.group_size == 1 and r.sent == 0 and r.received == 0 for r in ledger.records())
    assert ledger.totals(INTER) == LedgerTotals(0, 0, 2 + 4 * len(BITCAST_DTYPES))
    assert ledger.totals(INTRA) == LedgerTotals(0, 0, 2)
    assert [r.payload_bytes for r in ledger.records()][:3] == [12, 12, 8]  # int16 reduces as int32: 2 x 4 bytes


def test_default_ledger_is_the_global_one(world_of_one: str) -> None:
    with comm.get_ledger().capture() as seen:
        comm.all_reduce(torch.ones(4), label=INTER)
    assert seen.records()[0].op == "all_reduce"
    assert seen.records()[0].payload_bytes == 16


def test_point_to_point_needs_a_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="needs an initialized process group"):
        comm.send(torch.ones(1), 1, label=INTER)
    with pytest.raises(RuntimeError, match="needs an initialized process group"):
        comm.recv(torch.ones(1), 1, label=INTER)


def test_uninitialized_with_world_size_env_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"not initialized but WORLD_SIZE='2'.*init_process_group"):
        comm.all_reduce(torch.ones(1), label=INTER)


def test_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(TypeError):
        comm.all_reduce(torch.ones(1))  # type: ignore[call-arg]  # label is mandatory
    with pytest.raises(ValueError, match="label must be a non-empty string"):
        comm.all_reduce(torch.ones(1), label="")
    with pytest.raises(ValueError, match="Unsupported reduce op 'median'"):
        comm.all_reduce(torch.ones(1), "median", label=INTER)
    with pytest.raises(ValueError, match="op='avg' needs a floating-point tensor"):
        comm.all_reduce(torch.ones(1, dtype=torch.int32), "avg", label=INTER)
    with pytest.raises(TypeError, match="Reductions of dtype torch.bits16"):
        comm.all_reduce(torch.zeros(2, dtype=torch.int16).view(torch.bits16), label=INTER)
    with pytest.raises(ValueError, match="broadcast src=1"):
        comm.broadcast(torch.ones(1), 1, label=INTER)


def test_bitcast_output_must_be_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    transposed = torch.empty(4, 2, dtype=torch.int16).t()
    with pytest.raises(ValueError, match="output of dtype torch.int16 must be contiguous"):
        comm.all_gather_into_tensor(transposed, torch.ones(2, 4, dtype=torch.int16), label=INTER)
    native = torch.empty(4, 2).t()  # native dtypes go straight to torch, which copes with its own layouts
    comm.all_gather_into_tensor(native, torch.ones(2, 4), label=INTER)
    assert native.tolist() == torch.ones(2, 4).tolist()


@pytest.mark.parametrize("op", [torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.AVG, "MAX"])
def test_reduce_op_spellings(op: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    x = torch.tensor([2.0])
    comm.all_reduce(x, op, label=INTER)  # type: ignore[arg-type]
    assert x.tolist() == [2.0]


@pytest.mark.parametrize(
    ("dtype", "op", "per_rank", "expected"),
    [
        (torch.int16, "sum", [[30000, -5], [30001, 7]], [-5535, 2]),  # wraps modulo 2**16
        (torch.uint16, "max", [[60000, 1], [5, 65535]], [60000, 65535]),
        (torch.uint32, "sum", [[2**32 - 1, 1], [2, 2]], [1, 3]),
        (torch.uint64, "max", [[2**64 - 1, 2**63], [5, 1]], [2**64 - 1, 2**63]),  # signed max would pick 5 and 1
        (torch.uint64, "min", [[2**64 - 1, 2**63], [5, 1]], [5, 1]),
        (torch.uint64, "sum", [[2**64 - 1, 2**63], [2, 2**63]], [1, 0]),
        (torch.float8_e4m3fn, "sum", [[0.5, 448.0], [1.0, 448.0]], [1.5, 448.0]),  # e4m3fn saturates at 448
    ],
)
def test_reduction_wire_round_trip(dtype: torch.dtype, op: str, per_rank: list, expected: list) -> None:
    """Simulate a 2-rank reduction on the wire dtype, as gloo would do it, and cast back."""
    from lightning_hetero.comm.dtypes import GLOO_NATIVE_DTYPES, reduction_wire

    source = torch.float32 if dtype == torch.float8_e4m3fn else torch.int64
    tensors = [torch.tensor([v - 2**64 if v >= 2**63 else v for v in row], dtype=source) for row in per_rank]
    tensors = [t.view(torch.uint64) if dtype == torch.uint64 else t.to(dtype) for t in tensors]
    wires = [reduction_wire(t, op) for t in tensors]
    assert all(wire.dtype in GLOO_NATIVE_DTYPES for wire, _ in wires)
    stacked = torch.stack([wire for wire, _ in wires])
    reduced = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op].to(stacked.dtype)
    target, write_back = tensors[0], wires[0][1]
    write_back(reduced)
    assert target.dtype == dtype
    if dtype.is_floating_point:
        assert target.float().tolist() == expected
    else:
        assert target.tolist() == expected


def test_only_collectives_module_calls_torch_distributed_communication() -> None:
    """Design rule: every byte is counted, so no other package module may call a torch.distributed collective."""
    import re
    from pathlib import Path

    import lightning_hetero

    package = Path(lightning_hetero.__file__).parent
    call = re.compile(
        r"(\bdist|torch\.distributed|c10d)\s*\.\s*(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|"
        r"i?send|i?recv|all_to_all\w*|batch_isend_irecv|gather\w*|scatter\w*|reduce)\s*\("
        r"|from\s+torch\.distributed\s+import\s+[^\n]*\b(all_reduce|all_gather|broadcast|send|recv|reduce_scatter)"
    )
    offenders = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if path != package / "comm" / "collectives.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if call.search(line)
    ]
    assert offenders == [], "route these through lightning_hetero.comm (counted collectives):\n" + "\n".join(offenders)
