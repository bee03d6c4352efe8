"""Bit-packing codecs: exact round trips, exact byte counts, odd and empty counts, bad arguments; the validating
peer decoders (``unpack_peer_indices`` / ``unpack_peer_values``) refuse every invalid field, naming peer and field."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.comm.payload_packing import (
    dequantize_values,
    index_nbytes,
    pack_indices,
    pack_values,
    unpack_indices,
    unpack_peer_indices,
    unpack_peer_values,
    unpack_values,
    value_nbytes,
)
from lightning_hetero.comm.validation import PeerPayloadError


@pytest.mark.parametrize("bits", [12, 16])
@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 8, 1001])
def test_index_round_trip_and_size(bits: int, count: int, device: torch.device) -> None:
    generator = torch.Generator().manual_seed(count)
    indices = torch.randint(0, 1 << bits, (count,), generator=generator)
    if count >= 2:
        indices[0], indices[1] = (1 << bits) - 1, 0  # the extremes
    indices = indices.to(device)
    packed = pack_indices(indices, bits)
    assert packed.dtype == torch.uint8 and packed.device == device
    assert packed.numel() == index_nbytes(count, bits)
    assert torch.equal(unpack_indices(packed, count, bits), indices)


def test_index_byte_counts_exact() -> None:
    assert [index_nbytes(c, 12) for c in range(6)] == [0, 2, 3, 5, 6, 8]
    assert [index_nbytes(c, 16) for c in range(4)] == [0, 2, 4, 6]


def test_twelve_bit_layout_is_two_indices_in_three_bytes(device: torch.device) -> None:
    packed = pack_indices(torch.tensor([0xABC, 0x123], device=device), 12)
    assert packed.tolist() == [0xBC, 0x3A, 0x12]
    assert pack_indices(torch.tensor([0xABC], device=device), 12).tolist() == [0xBC, 0x0A]
    assert pack_indices(torch.tensor([0x1234], device=device), 16).tolist() == [0x34, 0x12]


def test_unpack_indices_rejects_short_buffers() -> None:
    with pytest.raises(ValueError, match="need 3 bytes"):
        unpack_indices(torch.zeros(2, dtype=torch.uint8), 2, 12)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "sign", "ternary"])
@pytest.mark.parametrize("shape", [(0, 0), (1, 1), (3, 5), (2, 9), (4, 16)])
def test_value_round_trip_and_size(encoding: str, shape: tuple[int, int], device: torch.device) -> None:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(device)
    packed = pack_values(values, encoding)
    rows, cols = shape
    assert packed.numel() == value_nbytes(rows * cols, encoding, rows)
    assert packed.dtype == torch.uint8 and packed.device == device
    decoded = unpack_values(packed, rows, cols, encoding)
    assert decoded.shape == (rows, cols) and decoded.dtype == torch.float32 and decoded.device == device
    assert torch.equal(decoded, dequantize_values(values, encoding))  # the sender's error feedback sees the same


def test_value_encodings_semantics(device: torch.device) -> None:
    values = torch.tensor([[1.0, -3.0, 0.25, 4.0], [0.0, 0.0, -2.0, 0.0]], device=device)
    assert torch.equal(unpack_values(pack_values(values, "fp32"), 2, 4, "fp32"), values)
    assert torch.equal(dequantize_values(values, "bf16"), values.to(torch.bfloat16).float())
    sign = dequantize_values(values, "sign")
    assert sign[0].tolist() == [2.0625, -2.0625, 2.0625, 2.0625]  # mean |v| of the row
    assert sign[1].tolist() == [0.5, 0.5, -0.5, 0.5]  # zero maps to +scale
    ternary = dequantize_values(values, "ternary")
    # row 0: mean |v| = 2.0625, threshold 1.03: 0.25 and 1.0 -> 0; scale = mean(3, 4) = 3.5
    assert ternary[0].tolist() == [0.0, -3.5, 0.0, 3.5]
    assert ternary[1].tolist() == [0.0, 0.0, -2.0, 0.0]


def test_value_byte_counts_exact() -> None:
    assert value_nbytes(9, "fp32") == 36
    assert value_nbytes(9, "bf16") == 18
    assert value_nbytes(9, "sign", rows=3) == 2 + 12
    assert value_nbytes(9, "ternary", rows=3) == 3 + 12
    assert value_nbytes(0, "sign", rows=0) == 0
    one_dim = pack_values(torch.randn(17), "sign")  # 1-D = one row
    assert one_dim.numel() == value_nbytes(17, "sign", 1) == 3 + 4


def test_bad_arguments_name_the_valid_values() -> None:
    with pytest.raises(ValueError, match=r"index_bits must be one of \[12, 16\]"):
        pack_indices(torch.zeros(2, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match=r"values must be one of \['fp32', 'bf16', 'sign', 'ternary'\]"):
        pack_values(torch.zeros(2), "int8")
    with pytest.raises(ValueError, match="count must be >= 0"):
        index_nbytes(-1, 12)


# --------------------------------------------------------------------------------------------- peer decoders
@pytest.mark.parametrize("bits", [12, 16])
@pytest.mark.parametrize("encoding", ["fp32", "bf16", "sign", "ternary"])
def test_peer_decoders_accept_what_the_packers_produce(bits: int, encoding: str, device: torch.device) -> None:
    generator = torch.Generator().manual_seed(bits)
    indices = torch.stack([torch.randperm(64, generator=generator)[:5] for _ in range(3)]).to(device)
    values = torch.randn(3, 5, generator=generator).to(device)
    decoded = unpack_peer_indices(pack_indices(indices, bits), 15, bits, limit=64, rows=3, peer=1)
    assert torch.equal(decoded, indices.reshape(-1))
    assert torch.equal(
        unpack_peer_values(pack_values(values, encoding), 3, 5, encoding, peer=1), dequantize_values(values, encoding)
    )


def _refused(decode, peer: int, field: str, match: str) -> None:
    with pytest.raises(PeerPayloadError, match=match) as error:
        decode()
    assert (error.value.peer, error.value.field) == (peer, field)


def test_peer_indices_refuse_range_repeats_padding_and_length(device: torch.device) -> None:
    packed = pack_indices(torch.tensor([1, 2, 3], device=device), 12)
    _refused(lambda: unpack_peer_indices(packed, 3, 12, limit=3, peer=2), 2, "indices", "rank 2 sent index 3 .*0, 3")
    repeated = pack_indices(torch.tensor([5, 5, 0, 1], device=device), 16)
    _refused(lambda: unpack_peer_indices(repeated, 4, 16, limit=8, rows=2, peer=0), 0, "indices", "repeats an index")
    assert unpack_peer_indices(repeated, 4, 16, limit=8, rows=4).tolist() == [5, 5, 0, 1]  # a repeat across rows
    padded = packed.clone()
    padded[-1] |= 0x10  # the lone last index's unused high nibble
    assert torch.equal(unpack_indices(padded, 3, 12), unpack_indices(packed, 3, 12))  # the trusting codec ignores it
    _refused(lambda: unpack_peer_indices(padded, 3, 12, limit=8, peer=1), 1, "indices", "padding bits")
    _refused(lambda: unpack_peer_indices(packed[:-1], 3, 12, limit=8, peer=1), 1, "indices", "sent 4 bytes")
    longer = torch.cat([packed, packed])
    _refused(lambda: unpack_peer_indices(longer, 3, 12, limit=8, peer=1), 1, "indices", "expected 5")
    _refused(lambda: unpack_peer_indices(packed.float(), 3, 12, limit=8, peer=1), 1, "indices", "not uint8")


def _ternary(codes: list[int], scale: float) -> torch.Tensor:
    body = sum(code << (2 * i) for i, code in enumerate(codes))
    return torch.cat([torch.tensor([body], dtype=torch.uint8), torch.tensor([scale]).view(torch.uint8)])


def test_peer_values_refuse_invalid_codes_scales_padding_and_values(device: torch.device) -> None:
    assert unpack_peer_values(_ternary([1, 2, 0], 2.0).to(device), 1, 3, "ternary").tolist() == [[2.0, -2.0, 0.0]]
    code_3 = _ternary([1, 3, 0], 2.0).to(device)
    assert unpack_values(code_3, 1, 3, "ternary").tolist() == [[2.0, 6.0, 0.0]]  # what used to be applied
    _refused(lambda: unpack_peer_values(code_3, 1, 3, "ternary", peer=1), 1, "values.codes", "ternary code 3")
    negative = _ternary([1, 2, 0], -2.0).to(device)
    _refused(lambda: unpack_peer_values(negative, 1, 3, "ternary", peer=1), 1, "values.scale", "negative scale")
    sign = pack_values(torch.tensor([[1.0, -1.0]], device=device), "sign")
    sign[-4:] = torch.tensor([-1.0]).view(torch.uint8).to(device)
    _refused(lambda: unpack_peer_values(sign, 1, 2, "sign", peer=3), 3, "values.scale", "negative scale")
    for bad in (float("nan"), float("inf"), 2.0**65):
        scaled = _ternary([1, 0, 0], bad).to(device)
        _refused(lambda scaled=scaled: unpack_peer_values(scaled, 1, 3, "ternary", peer=1), 1, "values.scale", "scale")
    padded = _ternary([1, 0, 0, 1], 1.0).to(device)  # a fourth code where only three are announced
    _refused(lambda: unpack_peer_values(padded, 1, 3, "ternary", peer=1), 1, "values.padding", "padding bits")
    for bad in (float("nan"), -float("inf"), 3.4e38):
        raw = torch.tensor([1.0, bad], device=device).view(torch.uint8)
        _refused(lambda raw=raw: unpack_peer_values(raw, 1, 2, "fp32", peer=1), 1, "values", "rank 1 sent")
    raw = torch.tensor([1.0, 2.0], device=device).view(torch.uint8)
    _refused(lambda: unpack_peer_values(raw[:-1], 1, 2, "fp32", peer=1), 1, "values", "sent 7 bytes")
