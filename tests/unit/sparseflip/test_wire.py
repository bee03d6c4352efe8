"""Sparse lists and flip sets: selection, codecs, validation (fuzzed), aggregation, byte counts, 1-process exchange."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hetero.comm import ByteLedger
from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE
from lightning_hetero.sparseflip import (
    SparseFlipExchange,
    aggregate_flips,
    decode_flips,
    decode_sparse,
    encode_flips,
    encode_sparse,
    exchange_bytes,
    select_sparse,
)
from lightning_hetero.sparseflip.wire import (
    BLOCK,
    flip_message_nbytes,
    index_bits,
    index_section_nbytes,
    num_blocks,
    sparse_message_nbytes,
)

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


@pytest.mark.parametrize("numel", [10, 4096, 4097, 65536, 65537, 70000, 200_000, 786_432])
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
    assert [index_bits(n) for n in (1, 4096, 4097, 65536, 65537, 2**32 - 1)] == [12, 12, 16, 16, 16, 16]
    assert [num_blocks(n) for n in (0, 65536, 65537, 131072, 131073, 786_432)] == [0, 0, 2, 2, 3, 12]
    assert sparse_message_nbytes(0, 100, "bf16") == 4  # empty list = the header
    assert sparse_message_nbytes(3, 100, "bf16") == 4 + 5 + 6  # 12-bit indices: ceil(36 / 8)
    assert sparse_message_nbytes(3, 10**6, "sign") == 4 + 34 + 6 + 1 + 4  # 16 blocks x 17 bits, 3 u16 offsets
    assert flip_message_nbytes(9, 5000) == 4 + 18 + 2
    assert flip_message_nbytes(9, 200_000) == 4 + 9 + 18 + 2  # 4 blocks x 17 bits = 8.5 -> 9 bytes
    assert sparse_message_nbytes(0, 10**6, "sign") == flip_message_nbytes(0, 10**6) == 4  # no table when empty
    with pytest.raises(ValueError, match="numel"):
        index_bits(2**32)


def test_one_percent_of_vit_tiny_costs_about_two_bytes_per_index() -> None:
    numel = 786_432  # ViT-tiny codes: 12 blocks
    count = -(-numel // 100)  # 1% density: 7,865 entries
    assert count == 7865
    per_index = index_section_nbytes(count, numel) / count
    assert 2.0 < per_index < 2.01  # 26 bytes of block table over 7,865 u16 offsets
    assert sparse_message_nbytes(count, numel, "bf16") == 4 + 26 + 2 * count + 2 * count == 31_490  # was 47,194
    assert sparse_message_nbytes(count, numel, "sign") == 4 + 26 + 2 * count + 984 + 4 == 16_748  # was 32,452
    gen = torch.Generator().manual_seed(1)
    idx = torch.randperm(numel, generator=gen)[:count].sort().values
    for encoding in ("bf16", "sign"):
        data = encode_sparse(idx, torch.randn(count, generator=gen), numel, encoding)
        assert data.numel() == sparse_message_nbytes(count, numel, encoding)
        assert torch.equal(decode_sparse(data, numel, encoding)[0], idx)
    dense_fp32 = 4 * numel
    assert dense_fp32 / sparse_message_nbytes(count, numel, "sign") > 180


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


# ------------------------------------------------------------------------------------ blocked layout (numel > 65536)
def _spec_index_section(table: list[int], offsets: list[int]) -> list[int]:
    """The documented blocked index section, written independently: 17-bit counts LSB-first, then u16 offsets."""
    bits = [(count >> j) & 1 for count in table for j in range(17)]
    bits += [0] * (-len(bits) % 8)
    out = [sum(bits[i + j] << j for j in range(8)) for i in range(0, len(bits), 8)]
    return out + [byte for offset in offsets for byte in (offset & 0xFF, offset >> 8)]


def _message(count: int, section: list[int], tail: list[int]) -> torch.Tensor:
    header = [(count >> s) & 0xFF for s in (0, 8, 16, 24)]
    return torch.tensor(header + section + tail, dtype=torch.uint8)


def test_blocked_layout_matches_the_documented_bytes() -> None:
    numel, idx = 200_000, [3, 65535, 65536, 131072 + 7, 199_999]  # blocks 0, 0, 1, 2, 3 (last: 3,392 codes)
    data = encode_flips(torch.tensor(idx), torch.tensor([1, -1, 1, 1, -1]), numel)
    offsets = [i % BLOCK for i in idx]
    assert data.tolist() == _message(5, _spec_index_section([2, 1, 1, 1], offsets), [0b10010]).tolist()
    values = torch.tensor([1.0, -2.0, 0.5, 3.0, -0.25])
    data = encode_sparse(torch.tensor(idx), values, numel, "fp32")
    expected = _message(5, _spec_index_section([2, 1, 1, 1], offsets), values.view(torch.uint8).tolist())
    assert data.tolist() == expected.tolist()


def _blocked_cases() -> list[tuple[int, torch.Tensor]]:
    last = 200_000 - 3 * BLOCK  # 3,392 codes in the last partial block
    return [
        (200_000, torch.zeros(0, dtype=torch.int64)),  # empty
        (200_000, torch.arange(4) * BLOCK),  # one entry per block, each at its block start
        (200_000, torch.tensor([BLOCK - 1, 2 * BLOCK - 1, 3 * BLOCK - 1, 199_999])),  # one per block, at its end
        (200_000, torch.arange(3 * BLOCK, 200_000)),  # the last partial block full
        (200_000, torch.cat((torch.tensor([5]), torch.arange(3 * BLOCK, 3 * BLOCK + last)))),
        (65537, torch.tensor([0, 65536])),  # the smallest blocked space: a 1-code last block
        (3 * BLOCK, torch.arange(BLOCK, 2 * BLOCK)),  # a full middle block: count 65536 needs the 17th bit
        (786_432, torch.tensor([786_431])),  # one entry, 11 empty blocks
    ]


@pytest.mark.parametrize("case", range(len(_blocked_cases())))
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_blocked_round_trips(case: int, encoding: str) -> None:
    numel, idx = _blocked_cases()[case]
    gen = torch.Generator().manual_seed(case)
    values = torch.randn(idx.numel(), generator=gen)
    data = encode_sparse(idx, values, numel, encoding)
    assert data.numel() == sparse_message_nbytes(idx.numel(), numel, encoding)
    out_idx, out_val = decode_sparse(data, numel, encoding)
    assert torch.equal(out_idx, idx) and out_val.numel() == idx.numel()
    if encoding == "fp32":
        assert torch.equal(out_val, values)
    directions = torch.where(torch.randn(idx.numel(), generator=gen) < 0, -1, 1).to(torch.int8)
    flips = encode_flips(idx, directions, numel)
    assert flips.numel() == flip_message_nbytes(idx.numel(), numel)
    out_idx, out_dirs = decode_flips(flips, numel)
    assert torch.equal(out_idx, idx) and torch.equal(out_dirs, directions)
    if idx.numel() == 0:
        assert data.tolist() == flips.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(
    "table,offsets,match",
    [
        ([1, 1, 0, 0], [5, 6, 7], "sum to 2, the header says 3"),
        ([2, 1, 1, 0], [5, 6, 7], "sum to 4, the header says 3"),
        ([0, 0, 0, 3393], [], "block 3 holds 3393 entries, more than its 3392"),  # last partial block
        ([65537, 0, 0, 0], [], "block 0 holds 65537 entries, more than its 65536"),
        ([0, 0, 0, 3], [1, 2, 3392], "out of range"),  # offset past the last block's 3,392 codes
        ([3, 0, 0, 0], [4, 9, 9], "strictly increasing"),  # a repeated offset in a block
        ([0, 3, 0, 0], [4, 9, 8], "strictly increasing"),  # offsets decreasing in a block
    ],
)
def test_blocked_decoders_reject_bad_tables_and_offsets(table: list[int], offsets: list[int], match: str) -> None:
    numel, count = 200_000, 3
    offsets = offsets if offsets else [0, 1, 2]
    section = _spec_index_section(table, offsets)
    with pytest.raises(ValueError, match=match):
        decode_sparse(_message(count, section, [0] * 6), numel, "bf16")
    with pytest.raises(ValueError, match=match):
        decode_flips(_message(count, section, [0]), numel)


def test_blocked_decoders_reject_table_padding_and_wrong_lengths() -> None:
    numel = 200_000  # 4 blocks x 17 bits = 68 bits: the top 4 bits of byte 8 are padding
    section = _spec_index_section([1, 0, 0, 0], [9])
    assert decode_flips(_message(1, section, [1]), numel)[0].tolist() == [9]
    section[8] |= 0x10
    with pytest.raises(ValueError, match="block-count table: non-zero padding"):
        decode_flips(_message(1, section, [1]), numel)
    with pytest.raises(ValueError, match="block-count table: non-zero padding"):
        decode_sparse(_message(1, section, [0, 0]), numel, "bf16")
    good = encode_sparse(torch.tensor([9]), torch.ones(1), numel, "bf16")
    for bad in (good[:-1], torch.cat((good, good[:1])), good[:4]):
        with pytest.raises(ValueError, match="bytes, expected"):
            decode_sparse(bad, numel, "bf16")
    with pytest.raises(ValueError, match="padding"):  # a direction padding bit
        decode_flips(_message(1, _spec_index_section([1, 0, 0, 0], [9]), [0b10]), numel)


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
    numel=st.sampled_from([1, 10, 5000, 70000, 200_000]),
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


@settings(max_examples=200, deadline=None, database=None)
@given(
    seed=st.integers(0, 10**6),
    flips=st.integers(0, 40),
    encoding=st.sampled_from(ENCODINGS),
    numel=st.sampled_from([5000, 200_000]),
)
def test_fuzz_single_byte_corruption_never_returns_garbage(seed: int, flips: int, encoding: str, numel: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(numel, generator=gen)[:flips].sort().values
    data = encode_sparse(idx, torch.randn(flips, generator=gen), numel, encoding)
    directions = torch.where(torch.randn(flips, generator=gen) < 0, -1, 1)
    for message, decode in (
        (data, lambda d: decode_sparse(d, numel, encoding)),
        (encode_flips(idx, directions, numel), lambda d: decode_flips(d, numel)),
    ):
        position = int(torch.randint(0, message.numel(), (1,), generator=gen))
        message[position] ^= int(torch.randint(1, 256, (1,), generator=gen))
        try:
            out_idx, out_val = decode(message)
        except ValueError:
            continue
        assert out_idx.numel() == out_val.numel() and bool((out_idx < numel).all())
        assert bool((out_idx[1:] > out_idx[:-1]).all()) and bool(torch.isfinite(out_val.float()).all())


@settings(max_examples=300, deadline=None, database=None)
@given(
    blocks=st.lists(st.integers(0, 3), max_size=12),
    offsets=st.lists(
        st.integers(0, 2**16 - 1) | st.integers(3380, 3400) | st.integers(0, 20), min_size=12, max_size=12
    ),
    bump=st.tuples(st.integers(0, 3), st.sampled_from([0, 0, 0, 0, 1, -1, 2**16, 2**17 - 1])),
    pad=st.sampled_from([0, 0, 0, 1, 8]),
    tail=st.binary(min_size=24, max_size=24),
    tidy=st.booleans(),
)
def test_fuzz_blocked_tables_decode_only_to_valid_lists(
    blocks: list[int], offsets: list[int], bump: tuple[int, int], pad: int, tail: bytes, tidy: bool
) -> None:
    numel, count = 200_000, len(blocks)
    table = [blocks.count(b) for b in range(4)]  # a consistent table, then maybe one count off (kept in 17 bits)
    table[bump[0]] = min(max(table[bump[0]] + bump[1], 0), 2**17 - 1)
    blocks, offsets = sorted(blocks), offsets[:count]
    if tidy:  # offsets ascending inside each block (they may still repeat or overrun the last block)
        offsets = [o for _, o in sorted(zip(blocks, offsets, strict=True))]
        tail = bytes(
            byte & ((1 << (count - 8 * i)) - 1) if 0 < count - 8 * i < 8 else byte for i, byte in enumerate(tail)
        )
    section = _spec_index_section(table, offsets)
    section[8] |= pad << 4  # the 4 padding bits after 4 x 17 table bits
    sizes = [BLOCK, BLOCK, BLOCK, numel - 3 * BLOCK]
    # the reference verdict: a table is only present (hence only valid) for a non-empty list
    valid = count > 0 and pad == 0 and sum(table) == count and all(c <= n for c, n in zip(table, sizes, strict=True))
    expected = [
        b * BLOCK + o for b, o in zip([b for b, c in enumerate(table) for _ in range(c)], offsets, strict=False)
    ]
    valid = (
        valid and all(i < numel for i in expected) and all(b > a for a, b in zip(expected, expected[1:], strict=False))
    )
    direction_bits = list(tail[: (count + 7) // 8])
    flips_valid = valid and all(
        byte >> (count - 8 * i) == 0 for i, byte in enumerate(direction_bits) if count - 8 * i < 8
    )
    try:
        idx, dirs = decode_flips(_message(count, section, direction_bits), numel)
    except ValueError:
        assert not flips_valid
    else:
        assert flips_valid and idx.tolist() == expected and dirs.numel() == count
    value_bytes = list(tail[: 2 * count])
    decoded = torch.tensor(value_bytes, dtype=torch.uint8).view(torch.bfloat16).float()
    finite = bool(torch.isfinite(decoded).all()) and bool((decoded.abs() <= MAX_PEER_MAGNITUDE).all())
    try:
        idx, values = decode_sparse(_message(count, section, value_bytes), numel, "bf16")
    except ValueError:
        assert not (valid and finite)
    else:
        assert valid and finite and idx.tolist() == expected and values.numel() == count


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
