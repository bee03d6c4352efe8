"""Bit-packing codecs: exact round trips, exact byte counts, odd and empty counts, bad arguments."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.comm.codecs import (
    dequantize_values,
    index_nbytes,
    pack_indices,
    pack_values,
    unpack_indices,
    unpack_values,
    value_nbytes,
)


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
