"""Sparse lists and flip sets: selection, codecs, validation (fuzzed), aggregation, byte counts, 1-process exchange."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hetero.comm import ByteLedger
from lightning_hetero.lowbit import (
    SparseFlipExchange,
    aggregate_flips,
    decode_flips,
    decode_sparse,
    encode_flips,
    encode_sparse,
    exchange_bytes,
    select_sparse,
)
from lightning_hetero.lowbit.wire import flip_message_nbytes, index_bits, sparse_message_nbytes

ENCODINGS = ["fp32", "bf16", "sign", "ternary"]


def test_select_by_threshold_and_density() -> None:
    g = torch.tensor([0.1, -2.0, 0.0, 0.5, -0.5, 3.0])
    idx, val = select_sparse(g, tau=0.4)
    assert idx.tolist() == [1, 3, 4, 5] and val.tolist() == [-2.0, 0.5, -0.5, 3.0]
    idx, _ = select_sparse(g, density=0.5)  # ceil(3): |3.0|, |-2.0|, then tie 0.5/-0.5 -> lower index
    assert idx.tolist() == [1, 3, 5]
    assert select_sparse(torch.zeros(4), density=1.0)[0].numel() == 0  # zeros never sent
    assert select_sparse(torch.arange(1.0, 101.0), density=0.07)[0].numel() == 7  # 0.07 * 100 = 7.000000000000001
    with pytest.raises(ValueError, match="exactly one"):
        select_sparse(g)
    with pytest.raises(ValueError, match="NaN"):
        select_sparse(torch.tensor([float("nan")]), tau=0.0)


@pytest.mark.parametrize("numel", [10, 4096, 4097, 70000])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_sparse_round_trip_and_size(numel: int, encoding: str) -> None:
    gen = torch.Generator().manual_seed(numel)
    idx = torch.randperm(numel, generator=gen)[: min(numel, 37)].sort().values
    idx[-1] = numel - 1
    val = torch.randn(idx.numel(), generator=gen)
    data = encode_sparse(idx, val, numel, encoding)
    assert data.dtype == torch.uint8 and data.numel() == sparse_message_nbytes(idx.numel(), numel, encoding)
    out_idx, out_val = decode_sparse(data, numel, encoding)
    assert torch.equal(out_idx, idx)
    if encoding == "fp32":
        assert torch.equal(out_val, val)
    elif encoding == "bf16":
        assert torch.equal(out_val, val.to(torch.bfloat16).float())
    else:
        assert torch.equal(torch.sign(out_val)[out_val != 0], torch.sign(val)[out_val != 0])


def test_index_widths_and_byte_counts_by_hand() -> None:
    assert [index_bits(n) for n in (1, 4096, 4097, 65536, 65537)] == [12, 12, 16, 16, 32]
    assert sparse_message_nbytes(0, 100, "bf16") == 4  # empty list = the header
    assert sparse_message_nbytes(3, 100, "bf16") == 4 + 5 + 6  # 12-bit indices: ceil(36 / 8)
    assert sparse_message_nbytes(3, 10**6, "sign") == 4 + 12 + 1 + 4
    assert flip_message_nbytes(9, 5000) == 4 + 18 + 2


def test_empty_messages() -> None:
    empty = torch.zeros(0, dtype=torch.int64)
    for encoding in ENCODINGS:
        data = encode_sparse(empty, torch.zeros(0), 50, encoding)
        assert data.tolist() == [0, 0, 0, 0]
        idx, val = decode_sparse(data, 50, encoding)
        assert idx.numel() == 0 and val.numel() == 0
    idx, dirs = decode_flips(encode_flips(empty, torch.zeros(0, dtype=torch.int8), 50), 50)
    assert idx.numel() == 0 and dirs.numel() == 0


def test_flip_round_trip() -> None:
    idx, dirs = torch.tensor([0, 5, 4999]), torch.tensor([1, -1, -1], dtype=torch.int8)
    data = encode_flips(idx, dirs, 5000)
    assert data.numel() == flip_message_nbytes(3, 5000)
    out = decode_flips(data, 5000)
    assert torch.equal(out[0], idx) and torch.equal(out[1], dirs)


def _valid(encoding: str = "fp32") -> torch.Tensor:
    return encode_sparse(torch.tensor([2, 7, 9]), torch.tensor([1.0, -2.0, 0.5]), 10, encoding)


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda d: d[:-1], "bytes, expected"),
        (lambda d: torch.cat((d, d[:1])), "bytes, expected"),
        (lambda d: d[:3], "header"),
        (lambda d: torch.cat((torch.tensor([11, 0, 0, 0], dtype=torch.uint8), d[4:])), "exceeds numel"),
    ],
)
def test_decode_rejects_wrong_length_and_count(corrupt, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_sparse(corrupt(_valid()), 10, "fp32")


def test_decode_rejects_bad_indices_and_values() -> None:
    data = _valid()
    data[4:9] = encode_sparse(torch.tensor([2, 7, 12]), torch.ones(3), 16, "fp32")[4:9]
    with pytest.raises(ValueError, match="out of range"):
        decode_sparse(data, 10, "fp32")
    data = encode_sparse(torch.tensor([2, 7, 9]), torch.ones(3), 10, "fp32")
    data[4:9] = torch.tensor([7, 2 << 4 & 0xFF, 0, 9, 0], dtype=torch.uint8)  # [7, 2, 9]: not increasing
    with pytest.raises(ValueError, match="increasing"):
        decode_sparse(data, 10, "fp32")
    for bad in (float("nan"), float("inf")):
        data = _valid()
        data[-4:] = torch.tensor([bad]).view(torch.uint8)
        with pytest.raises(ValueError, match="NaN or Inf"):
            decode_sparse(data, 10, "fp32")
    data = _valid("ternary")
    data[-5] = 0b11  # first code = 3
    with pytest.raises(ValueError, match="code 3"):
        decode_sparse(data, 10, "ternary")
    data = _valid("sign")
    data[-4:] = torch.tensor([-1.0]).view(torch.uint8)
    with pytest.raises(ValueError, match="scale"):
        decode_sparse(data, 10, "sign")
    with pytest.raises(ValueError, match="uint8"):
        decode_sparse(torch.zeros(8), 10, "fp32")


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="increasing"):
        encode_sparse(torch.tensor([3, 3]), torch.ones(2), 10)
    with pytest.raises(ValueError, match="NaN"):
        encode_sparse(torch.tensor([3]), torch.tensor([float("nan")]), 10)
    with pytest.raises(ValueError, match="directions"):
        encode_flips(torch.tensor([1]), torch.tensor([0]), 10)


@settings(max_examples=300, deadline=None, database=None)
@given(
    raw=st.binary(max_size=64),
    numel=st.sampled_from([1, 10, 5000, 70000]),
    encoding=st.sampled_from(ENCODINGS),
)
def test_fuzz_decoders_raise_value_error_or_return_valid(raw: bytes, numel: int, encoding: str) -> None:
    data = torch.tensor(list(raw), dtype=torch.uint8)
    for decode in (lambda d: decode_sparse(d, numel, encoding), lambda d: decode_flips(d, numel)):
        try:
            idx, values = decode(data)
        except ValueError:
            continue
        assert idx.numel() == values.numel()
        assert bool(((idx >= 0) & (idx < numel)).all()) and bool((idx[1:] > idx[:-1]).all())
        assert bool(torch.isfinite(values.float()).all())


@settings(max_examples=100, deadline=None, database=None)
@given(seed=st.integers(0, 10**6), flips=st.integers(0, 40), encoding=st.sampled_from(ENCODINGS))
def test_fuzz_single_byte_corruption_never_returns_garbage(seed: int, flips: int, encoding: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(5000, generator=gen)[:flips].sort().values
    data = encode_sparse(idx, torch.randn(flips, generator=gen), 5000, encoding)
    position = int(torch.randint(0, data.numel(), (1,), generator=gen))
    data[position] ^= int(torch.randint(1, 256, (1,), generator=gen))
    try:
        out_idx, out_val = decode_sparse(data, 5000, encoding)
    except ValueError:
        return
    assert bool((out_idx < 5000).all()) and bool(torch.isfinite(out_val).all())


def test_aggregate_sums_drops_saturated_and_picks_topk() -> None:
    codes = torch.tensor([1, 0, -1, 0, 0], dtype=torch.int8)
    lists = [
        (torch.tensor([0, 1, 3]), torch.tensor([-5.0, 1.0, 0.5])),
        (torch.tensor([1, 2, 4]), torch.tensor([1.0, 4.0, -0.1])),
    ]
    # dense = [-5, 2, 4, 0.5, -0.1]; index 0 wants +1 but is +1, index 2 wants -1 but is -1: both saturated
    idx, dirs = aggregate_flips(lists, codes, 2)
    assert idx.tolist() == [1, 3] and dirs.tolist() == [-1, -1]


def test_exchange_bytes_formula() -> None:
    assert exchange_bytes([10, 4, 20], 9, "server", server=0) == [(18, 24), (4, 9), (20, 9)]
    assert exchange_bytes([10, 4, 20], 9, "allgather") == [(40, 40)] * 3
    assert exchange_bytes([10], 9, "server") == [(0, 0)]


@pytest.mark.parametrize("mode", ["server", "allgather"])
def test_single_process_exchange_equals_local_aggregation(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    grad, codes = torch.randn(300, generator=gen), torch.randint(-1, 2, (300,), generator=gen).to(torch.int8)
    ledger = ByteLedger()
    exchange = SparseFlipExchange(300, k=10, density=0.2, encoding="fp32", mode=mode, ledger=ledger)
    idx, dirs = exchange.step(grad, codes)
    expected = aggregate_flips([select_sparse(grad, density=0.2)], codes, 10)
    assert torch.equal(idx, expected[0]) and torch.equal(dirs, expected[1])
    assert exchange.last_bytes == (0, 0) and ledger.totals().sent == 0
