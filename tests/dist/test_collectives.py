"""Every counted collective on 2 and 4 spawned gloo ranks: correct values and exact per-rank ledger bytes.

One launch per world size runs every check (spawning costs seconds on this box); the module fixture keeps its
results and each test below asserts one family of them against values and byte counts computed here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_hetero import comm
from lightning_hetero.comm import INTER, INTRA, PIPELINE, ByteLedger, CommRecord
from lightning_hetero.testing import run_distributed

pytestmark = pytest.mark.timeout(120)

BITCAST_DTYPES = {
    "int16": torch.int16,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,  # native in gloo: the wrapper must not get in its way
}


def _pattern(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Deterministic arbitrary bit patterns of ``dtype``, different per ``seed`` (the rank)."""
    size = torch.empty(0, dtype=dtype).element_size()
    raw = (torch.arange(numel * size, dtype=torch.int64) * 37 + 11 + 53 * seed).remainder(251)
    return raw.to(torch.uint8).view(dtype)


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _rows_sent(src: int, dst: int) -> int:
    """Uneven all_to_all split: rows rank ``src`` sends to rank ``dst`` (asymmetric on purpose)."""
    return (src + 2 * dst) % 3 + 1


# ------------------------------------------------------------------------------------------------ child process
def _exercise_collectives(rank: int, world_size: int) -> dict[str, Any]:
    """Run every wrapper once (or a few times); return values and the ledger records of each check."""
    n, values, records = world_size, {}, {}

    def check(name: str) -> ByteLedger:
        records[name] = ByteLedger()
        return records[name]

    # --- all_reduce, native dtypes
    x = torch.tensor([rank + 1.0, 2.0 * rank, -1.0, 0.5, 3.0])
    comm.all_reduce(x, label=INTER, ledger=check("all_reduce_sum_f32"))
    values["all_reduce_sum_f32"] = x.tolist()
    x = torch.tensor([rank + 1, 2, 3], dtype=torch.uint8)  # S = 3 bytes: 2(n-1)S/n is fractional for n = 4
    comm.all_reduce(x, label=INTER, ledger=check("all_reduce_sum_u8"))
    values["all_reduce_sum_u8"] = x.tolist()
    x = torch.arange(7, dtype=torch.float32) * rank
    comm.all_reduce(x, "avg", label=INTER, ledger=check("all_reduce_avg_f32"))
    values["all_reduce_avg_f32"] = x.tolist()
    x = torch.arange(7, dtype=torch.float32) * rank
    handle = comm.all_reduce(x, "avg", label=INTER, ledger=check("all_reduce_avg_async"), async_op=True)
    values["all_reduce_avg_async_calls_before_wait"] = records["all_reduce_avg_async"].totals().calls
    handle.wait()
    values["all_reduce_avg_async"] = x.tolist()
    for op in ("max", "min", "product"):
        x = torch.tensor([rank + 1.0, -(rank + 1.0)], dtype=torch.float64)
        comm.all_reduce(x, op, label=INTRA, ledger=check(f"all_reduce_{op}_f64"))
        values[f"all_reduce_{op}_f64"] = x.tolist()

    # --- all_reduce, upcast dtypes
    x = torch.tensor([30000 + rank, -3 * rank, 1000 * rank], dtype=torch.int16)
    comm.all_reduce(x, label=INTER, ledger=check("all_reduce_sum_int16"))
    values["all_reduce_sum_int16"] = x.tolist()
    x = torch.tensor([65535 - rank, rank], dtype=torch.int32).to(torch.uint16)
    comm.all_reduce(x, label=INTER, ledger=check("all_reduce_sum_uint16"))
    values["all_reduce_sum_uint16"] = x.tolist()
    x = torch.tensor([60000 + rank], dtype=torch.int32).to(torch.uint16)
    comm.all_reduce(x, "max", label=INTER, ledger=check("all_reduce_max_uint16"))
    values["all_reduce_max_uint16"] = x.tolist()
    x = torch.tensor([2**32 - 1 - rank, 7], dtype=torch.int64).to(torch.uint32)
    comm.all_reduce(x, label=INTER, ledger=check("all_reduce_sum_uint32"))
    values["all_reduce_sum_uint32"] = x.tolist()
    big = [2**63 + rank, rank, 2**64 - 1 if rank == 0 else 5]
    for op in ("sum", "max", "min"):
        x = torch.tensor(big, dtype=torch.uint64)
        comm.all_reduce(x, op, label=INTER, ledger=check(f"all_reduce_{op}_uint64"))
        values[f"all_reduce_{op}_uint64"] = x.tolist()
    x = torch.tensor([0.5 * (rank + 1), 1.0]).to(torch.float8_e4m3fn)
    comm.all_reduce(x, label=INTER, ledger=check("all_reduce_sum_float8_e4m3fn"))
    values["all_reduce_sum_float8_e4m3fn"] = x.float().tolist()
    x = torch.tensor([0.25 * (rank + 1), 2.0]).to(torch.float8_e5m2)
    comm.all_reduce(x, "avg", label=INTER, ledger=check("all_reduce_avg_float8_e5m2"))
    values["all_reduce_avg_float8_e5m2"] = x.float().tolist()

    # --- all_gather
    out = torch.empty(n * 3)
    comm.all_gather_into_tensor(out, torch.tensor([rank, 10.0 + rank, -rank]), label=INTER, ledger=check("ag_f32"))
    values["ag_f32"] = out.tolist()
    for name, dtype in BITCAST_DTYPES.items():
        outputs = [torch.empty(5, dtype=dtype) for _ in range(n)]
        comm.all_gather(outputs, _pattern(dtype, 5, rank), label=INTER, ledger=check(f"ag_list_{name}"))
        values[f"ag_list_{name}"] = [_raw(t) for t in outputs]
    out = torch.empty(n, 3, dtype=torch.int16)
    handle = comm.all_gather_into_tensor(
        out, _pattern(torch.int16, 3, rank).view(1, 3), label=INTER, ledger=check("ag_int16_async"), async_op=True
    )
    values["ag_int16_async_calls_before_wait"] = records["ag_int16_async"].totals().calls
    handle.wait()
    values["ag_int16_async"] = _raw(out)

    # --- broadcast from the last rank (not 0)
    for name, dtype, numel in (
        ("int16", torch.int16, 7),
        ("float32", torch.float32, 3),
        ("e5m2", torch.float8_e5m2, 5),
    ):
        x = _pattern(dtype, numel, rank).clone()
        comm.broadcast(x, n - 1, label=PIPELINE, ledger=check(f"bcast_{name}"))
        values[f"bcast_{name}"] = _raw(x)

    # --- reduce_scatter_tensor
    full = torch.arange(n * 3, dtype=torch.float32) + 100.0 * rank
    out = torch.empty(3)
    comm.reduce_scatter_tensor(out, full, label=INTRA, ledger=check("rs_sum_f32"))
    values["rs_sum_f32"] = out.tolist()
    out = torch.empty(3)
    comm.reduce_scatter_tensor(out, full, "avg", label=INTRA, ledger=check("rs_avg_f32"))
    values["rs_avg_f32"] = out.tolist()
    out = torch.empty(3, dtype=torch.int16)
    full16 = (torch.arange(n * 3, dtype=torch.int32) + 16000 * rank).to(torch.int16)
    comm.reduce_scatter_tensor(out, full16, label=INTRA, ledger=check("rs_sum_int16"))
    values["rs_sum_int16"] = out.tolist()

    # --- send / recv around a ring (even ranks send first so blocking calls cannot deadlock)
    dst, src = (rank + 1) % n, (rank - 1) % n
    for name, dtype, numel in (("int16", torch.int16, 5), ("e4m3", torch.float8_e4m3fn, 3), ("f32", torch.float32, 4)):
        incoming = torch.empty(numel, dtype=dtype)
        ledger = check(f"p2p_{name}")
        sent_first = rank % 2 == 0
        if sent_first:
            comm.send(_pattern(dtype, numel, rank), dst, label=PIPELINE, ledger=ledger)
        sender = comm.recv(incoming, src if name != "f32" else None, label=PIPELINE, ledger=ledger)
        if not sent_first:
            comm.send(_pattern(dtype, numel, rank), dst, label=PIPELINE, ledger=ledger)
        values[f"p2p_{name}"] = (_raw(incoming), sender)
    incoming = torch.empty(6, dtype=torch.uint16)
    ledger = check("p2p_async_uint16")
    receiving = comm.irecv(incoming, src, label=PIPELINE, ledger=ledger)
    sending = comm.isend(_pattern(torch.uint16, 6, rank), dst, label=PIPELINE, ledger=ledger)
    sending.wait()
    receiving.wait()
    values["p2p_async_uint16"] = _raw(incoming)

    # --- all_to_all_single, even and uneven splits, native and bit-cast
    out = torch.empty(n * 2, 3)
    comm.all_to_all_single(out, _pattern(torch.float32, n * 6, rank).view(n * 2, 3), label=INTER, ledger=check("a2a"))
    values["a2a"] = _raw(out)
    in_splits = [_rows_sent(rank, j) for j in range(n)]
    out_splits = [_rows_sent(j, rank) for j in range(n)]
    for name, dtype in (("f32", torch.float32), ("uint16", torch.uint16)):
        out = torch.empty(sum(out_splits), 2, dtype=dtype)
        source = _pattern(dtype, sum(in_splits) * 2, rank).view(-1, 2)
        comm.all_to_all_single(out, source, out_splits, in_splits, label=INTER, ledger=check(f"a2a_uneven_{name}"))
        values[f"a2a_uneven_{name}"] = _raw(out)

    # --- sub-groups: pairs, and a group of one (every rank must create every group, in the same order)
    pairs = [dist.new_group([i, i + 1]) for i in range(0, n, 2)]
    singles = [dist.new_group([i]) for i in range(n)]
    x = torch.tensor([float(rank + 1)] * 3)
    comm.all_reduce(x, label=INTRA, group=pairs[rank // 2], ledger=check("pair_all_reduce"))
    values["pair_all_reduce"] = x.tolist()
    x = torch.tensor([float(rank + 1)] * 3)
    comm.all_reduce(x, label=INTRA, group=singles[rank], ledger=check("single_all_reduce"))
    values["single_all_reduce"] = x.tolist()
    if rank >= 2:  # not in pairs[0]: torch would silently skip; we refuse
        try:
            comm.all_reduce(torch.ones(1), label=INTRA, group=pairs[0])
        except ValueError as error:
            values["non_member"] = str(error)

    # --- the global ledger is the default; barrier is not recorded
    with comm.get_ledger().capture() as seen:
        comm.all_reduce(torch.ones(4), label=INTER)
        comm.barrier()
    records["global_ledger"] = seen
    return {"values": values, "records": {name: ledger.records() for name, ledger in records.items()}}


# ------------------------------------------------------------------------------------------------------ parent
@pytest.fixture(scope="module", params=[2, 4], ids=["n2", "n4"])
def outcome(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world_size = request.param
    return world_size, run_distributed(_exercise_collectives, world_size, timeout=90.0)


def _only(results: dict[str, Any], name: str) -> list[CommRecord]:
    return results["records"][name]


def _assert_bytes(result: dict[str, Any], name: str, op: str, n: int, payload: int, sent: int, received: int) -> None:
    (record,) = _only(result, name)
    assert (record.op, record.group_size, record.payload_bytes, record.sent, record.received) == (
        op,
        n,
        payload,
        sent,
        received,
    ), name


def test_all_reduce_values(outcome: tuple[int, list[dict[str, Any]]]) -> None:
    n, results = outcome
    triangle = n * (n + 1) // 2
    mean = [i * (n - 1) / 2 for i in range(7)]
    wrap16 = lambda v: (v + 2**15) % 2**16 - 2**15  # noqa: E731
    for rank, result in enumerate(results):
        values = result["values"]
        assert values["all_reduce_sum_f32"] == [triangle, n * (n - 1), -n, 0.5 * n, 3.0 * n]
        assert values["all_reduce_sum_u8"] == [triangle, 2 * n, 3 * n]
        assert values["all_reduce_avg_f32"] == mean
        assert values["all_reduce_avg_async"] == mean
        assert values["all_reduce_max_f64"] == [n, -1.0]
        assert values["all_reduce_min_f64"] == [1.0, -n]
        assert values["all_reduce_product_f64"] == [float(torch.arange(1, n + 1).prod())] * 2
        expected16 = [wrap16(sum(30000 + r for r in range(n))), -3 * triangle + 3 * n, 1000 * (triangle - n)]
        assert values["all_reduce_sum_int16"] == expected16, "int16 sums wrap modulo 2**16"
        assert values["all_reduce_sum_uint16"] == [(65536 * n - n * (n - 1) // 2 - n) % 2**16, n * (n - 1) // 2]
        assert values["all_reduce_max_uint16"] == [60000 + n - 1]
        assert values["all_reduce_sum_uint32"] == [(2**32 * n - n - n * (n - 1) // 2) % 2**32, 7 * n]
        big = [[2**63 + r, r, 2**64 - 1 if r == 0 else 5] for r in range(n)]
        assert values["all_reduce_sum_uint64"] == [sum(col) % 2**64 for col in zip(*big, strict=True)]
        assert (
            values["all_reduce_max_uint64"]
            == [max(col) for col in zip(*big, strict=True)]
            == [2**63 + n - 1, n - 1, 2**64 - 1]
        )
        assert values["all_reduce_min_uint64"] == [min(col) for col in zip(*big, strict=True)] == [2**63, 0, 5]
        assert values["all_reduce_sum_float8_e4m3fn"] == [0.5 * triangle, float(n)]
        assert values["all_reduce_avg_float8_e5m2"] == [0.25 * triangle / n, 2.0]
        assert values["pair_all_reduce"] == [float(4 * (rank // 2) + 3)] * 3
        assert values["single_all_reduce"] == [float(rank + 1)] * 3
        if rank >= 2:
            assert (
                values["non_member"]
                == f"lightning_hetero.comm.all_reduce: global rank {rank} is not a member of the given process group."
            )


def test_all_reduce_bytes(outcome: tuple[int, list[dict[str, Any]]]) -> None:
    n, results = outcome
    ring = {
        2: {20: 20, 3: 3, 28: 28, 16: 16, 12: 12, 24: 24, 8: 8},
        4: {20: 30, 3: 4, 28: 42, 16: 24, 12: 18, 24: 36, 8: 12},
    }
    for result in results:
        assert result["values"]["all_reduce_avg_async_calls_before_wait"] == 1, "async bytes are recorded at issue"
        for name, payload in [
            ("all_reduce_sum_f32", 20),
            ("all_reduce_sum_u8", 3),  # n=4: floor(2*3*3/4) = floor(4.5) = 4
            ("all_reduce_avg_f32", 28),
            ("all_reduce_avg_async", 28),
            ("all_reduce_max_f64", 16),
            ("all_reduce_sum_int16", 12),  # 3 int16 travel as 3 int32
            ("all_reduce_sum_uint16", 8),  # 2 uint16 travel as 2 int32
            ("all_reduce_sum_uint32", 16),  # 2 uint32 travel as 2 int64
            ("all_reduce_max_uint64", 24),
            ("all_reduce_sum_float8_e4m3fn", 8),  # 2 fp8 travel as 2 float32
            ("all_reduce_avg_float8_e5m2", 8),
        ]:
            both = ring[n][payload]
            assert both == 2 * (n - 1) * payload // n
            _assert_bytes(result, name, "all_reduce", n, payload, both, both)
        _assert_bytes(result, "pair_all_reduce", "all_reduce", 2, 12, 12, 12)
        _assert_bytes(result, "single_all_reduce", "all_reduce", 1, 12, 0, 0)
        (record,) = _only(result, "global_ledger")
        assert (record.op, record.label, record.sent) == ("all_reduce", INTER, {2: 16, 4: 24}[n])
        assert all(r.label == INTER for r in _only(result, "all_reduce_sum_f32"))


def test_all_gather(outcome: tuple[int, list[dict[str, Any]]]) -> None:
    n, results = outcome
    for result in results:
        values = result["values"]
        assert values["ag_f32"] == [v for r in range(n) for v in (r, 10.0 + r, -r)]
        _assert_bytes(result, "ag_f32", "all_gather_into_tensor", n, 12, (n - 1) * 12, (n - 1) * 12)
        for name, dtype in BITCAST_DTYPES.items():
            assert values[f"ag_list_{name}"] == [_raw(_pattern(dtype, 5, r)) for r in range(n)], name
            local = 5 * torch.empty(0, dtype=dtype).element_size()
            _assert_bytes(result, f"ag_list_{name}", "all_gather", n, local, (n - 1) * local, (n - 1) * local)
        assert values["ag_int16_async_calls_before_wait"] == 1
        assert values["ag_int16_async"] == b"".join(_raw(_pattern(torch.int16, 3, r)) for r in range(n))
        _assert_bytes(result, "ag_int16_async", "all_gather_into_tensor", n, 6, (n - 1) * 6, (n - 1) * 6)


def test_broadcast(outcome: tuple[int, list[dict[str, Any]]]) -> None:
    n, results = outcome
    root = n - 1
    for rank, result in enumerate(results):
        for name, dtype, numel in (
            ("int16", torch.int16, 7),
            ("float32", torch.float32, 3),
            ("e5m2", torch.float8_e5m2, 5),
        ):
            assert result["values"][f"bcast_{name}"] == _raw(_pattern(dtype, numel, root)), name
            payload = numel * torch.empty(0, dtype=dtype).element_size()
            sent, received = ((n - 1) * payload, 0) if rank == root else (0, payload)
            _assert_bytes(result, f"bcast_{name}", "broadcast", n, payload, sent, received)
            assert _only(result, f"bcast_{name}")[0].label == PIPELINE


def test_reduce_scatter(outcome: tuple[int, list[dict[str, Any]]]) -> None:
    n, results = outcome
    offsets = 100.0 * n * (n - 1) / 2
    for rank, result in enumerate(results):
        chunk = [float(i) for i in range(3 * rank, 3 * rank + 3)]
        assert result["values"]["rs_sum_f32"] == [n * v + offsets for v in chunk]
        assert result["values"]["rs_avg_f32"] == [v + offsets / n for v in chunk]
        wrap16 = [((n * int(v) + 16000 * n * (n - 1) // 2) + 2**15) % 2**16 - 2**15 for v in chunk]
        assert result["values"]["rs_sum_int16"] == wrap16
        # S = the full input: n*3 float32; sent = received = floor((n-1) S / n) = (n-1)*12
        _assert_bytes(result, "rs_sum_f32", "reduce_scatter_tensor", n, n * 12, (n - 1) * 12, (n - 1) * 12)
        _assert_bytes(result, "rs_avg_f32", "reduce_scatter_tensor", n, n * 12, (n - 1) * 12, (n - 1) * 12)
        _assert_bytes(result, "rs_sum_int16", "reduce_scatter_tensor", n, n * 12, (n - 1) * 12, (n - 1) * 12)


def test_send_recv(outcome: tuple[int, list[dict[str, Any]]]) -> None:
    n, results = outcome
    for rank, result in enumerate(results):
        src = (rank - 1) % n
        for name, dtype, numel in (
            ("int16", torch.int16, 5),
            ("e4m3", torch.float8_e4m3fn, 3),
            ("f32", torch.float32, 4),
        ):
            data, sender = result["values"][f"p2p_{name}"]
            assert data == _raw(_pattern(dtype, numel, src)), name
            assert sender == src
            size = numel * torch.empty(0, dtype=dtype).element_size()
            by_op = {r.op: r for r in _only(result, f"p2p_{name}")}
            assert (by_op["send"].sent, by_op["send"].received, by_op["send"].payload_bytes) == (size, 0, size)
            assert (by_op["recv"].sent, by_op["recv"].received, by_op["recv"].payload_bytes) == (0, size, size)
        assert result["values"]["p2p_async_uint16"] == _raw(_pattern(torch.uint16, 6, src))
        by_op = {r.op: r for r in _only(result, "p2p_async_uint16")}
        assert (by_op["isend"].sent, by_op["isend"].received) == (12, 0)
        assert (by_op["irecv"].sent, by_op["irecv"].received) == (0, 12)


def test_all_to_all(outcome: tuple[int, list[dict[str, Any]]]) -> None:
    n, results = outcome
    for rank, result in enumerate(results):
        inputs = [_pattern(torch.float32, n * 6, r).view(n * 2, 3) for r in range(n)]
        assert result["values"]["a2a"] == b"".join(_raw(inputs[j][2 * rank : 2 * rank + 2]) for j in range(n))
        # S = n*2 rows of 12 bytes; the 24-byte block for itself stays home
        _assert_bytes(result, "a2a", "all_to_all_single", n, n * 24, (n - 1) * 24, (n - 1) * 24)
        for name, dtype in (("f32", torch.float32), ("uint16", torch.uint16)):
            expected = []
            for j in range(n):
                rows_of_j = [_rows_sent(j, k) for k in range(n)]
                source = _pattern(dtype, sum(rows_of_j) * 2, j).view(-1, 2)
                start = sum(rows_of_j[:rank])
                expected.append(_raw(source[start : start + rows_of_j[rank]]))
            assert result["values"][f"a2a_uneven_{name}"] == b"".join(expected), name
            row = 2 * torch.empty(0, dtype=dtype).element_size()
            rows_in = sum(_rows_sent(rank, j) for j in range(n))
            rows_out = sum(_rows_sent(j, rank) for j in range(n))
            own = _rows_sent(rank, rank)
            sent, received = (rows_in - own) * row, (rows_out - own) * row
            _assert_bytes(result, f"a2a_uneven_{name}", "all_to_all_single", n, rows_in * row, sent, received)
        if n == 4 and rank == 1:  # the uneven split really is uneven: 7 rows out, 8 rows in, 4 bytes per uint16 row
            assert (sent, received) == (28, 32)
