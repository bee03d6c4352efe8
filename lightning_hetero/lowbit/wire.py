"""Wire format of the sparse flip exchange: sparse gradient lists and flip sets as validated ``uint8`` bytes.

Messages are flat ``uint8`` tensors, little-endian, no pickle (``n = count``)::

    sparse list: count:u32 | indices | values        flip set: count:u32 | indices | direction bits

Indices use ``index_bits(numel)`` bits: 12 or 16 (the :mod:`lightning_hetero.comm.codecs` layouts) when ``numel``
fits, else 32 (4 bytes, low byte first). Values use a codec value encoding (``fp32``, ``bf16``, ``sign``, ``ternary``;
the last two with one fp32 scale for the list). Direction bits: bit ``i % 8`` of byte ``i // 8`` set means ``-1``.
An empty list is the 4-byte header ``0``. Decoders reject with a ValueError any wrong length, count above ``numel``,
index out of range or not strictly increasing, non-canonical padding, invalid ternary code, NaN/Inf value or a
negative / non-finite scale: nothing is ever applied silently.
"""

from __future__ import annotations

import torch

from lightning_hetero.comm import codecs

__all__ = [
    "HEADER_BYTES",
    "decode_flips",
    "decode_sparse",
    "encode_flips",
    "encode_sparse",
    "flip_message_nbytes",
    "index_bits",
    "read_count",
    "sparse_message_nbytes",
]

HEADER_BYTES = 4
_MAX_NUMEL = 2**32 - 1


# ------------------------------------------------------------------------------------------------- layouts
def index_bits(numel: int) -> int:
    """Bits per index for a flat space of ``numel`` codes: 12, 16 or 32."""
    if numel < 0 or numel > _MAX_NUMEL:
        raise ValueError(f"numel must be in [0, 2**32), got {numel}.")
    return 12 if numel <= 4096 else 16 if numel <= 65536 else 32


def _index_nbytes(count: int, bits: int) -> int:
    return 4 * count if bits == 32 else codecs.index_nbytes(count, bits)


def _value_nbytes(count: int, encoding: str) -> int:
    return codecs.value_nbytes(count, encoding, rows=1 if count else 0)


def sparse_message_nbytes(count: int, numel: int, encoding: str = "bf16") -> int:
    """Exact size of an encoded sparse list of ``count`` entries."""
    return HEADER_BYTES + _index_nbytes(count, index_bits(numel)) + _value_nbytes(count, encoding)


def flip_message_nbytes(count: int, numel: int) -> int:
    """Exact size of an encoded flip set of ``count`` moves."""
    return HEADER_BYTES + _index_nbytes(count, index_bits(numel)) + (count + 7) // 8


def _u32(value: int) -> torch.Tensor:
    return torch.tensor([(value >> s) & 0xFF for s in (0, 8, 16, 24)], dtype=torch.uint8)


def read_count(data: torch.Tensor) -> int:
    """The little-endian u32 count in the first 4 bytes of a message."""
    return sum(int(b) << s for b, s in zip(data[:4].tolist(), (0, 8, 16, 24), strict=True))


def _pack_idx(indices: torch.Tensor, bits: int) -> torch.Tensor:
    if bits != 32:
        return codecs.pack_indices(indices, bits)
    flat = indices.reshape(-1).to(torch.int64)
    return torch.stack([(flat >> s) & 0xFF for s in (0, 8, 16, 24)], dim=1).reshape(-1).to(torch.uint8)


def _unpack_idx(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    if bits != 32:
        indices = codecs.unpack_indices(data, count, bits)
        if not torch.equal(codecs.pack_indices(indices, bits), data):
            raise ValueError("non-canonical index encoding (padding bits set).")
        return indices
    words = data.to(torch.int64).view(-1, 4)
    return words[:, 0] | (words[:, 1] << 8) | (words[:, 2] << 16) | (words[:, 3] << 24)


def _check_bytes(data: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise ValueError(f"{what} must be a uint8 tensor, got {type(data).__name__} {getattr(data, 'dtype', '')}.")
    data = data.reshape(-1).cpu()
    if data.numel() < HEADER_BYTES:
        raise ValueError(f"{what} is {data.numel()} bytes, shorter than its {HEADER_BYTES}-byte header.")
    return data


def _check_indices(indices: torch.Tensor, numel: int, what: str) -> None:
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
        raise ValueError(f"{what}: index out of range [0, {numel}).")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"{what}: indices must be strictly increasing.")


def _check_length(data: torch.Tensor, count: int, numel: int, expected: int, what: str) -> None:
    if count > numel:
        raise ValueError(f"{what}: count {count} exceeds numel {numel}.")
    if data.numel() != expected:
        raise ValueError(f"{what}: {data.numel()} bytes, expected {expected} for {count} entries.")


def encode_sparse(indices: torch.Tensor, values: torch.Tensor, numel: int, encoding: str = "bf16") -> torch.Tensor:
    """Encode a sparse list (indices strictly increasing, in ``[0, numel)``) as ``uint8`` bytes.

    Raises:
        ValueError: Bad indices, mismatched lengths or non-finite values.
    """
    encoding = codecs.validate_value_encoding(encoding)
    indices, values = indices.reshape(-1).cpu().long(), values.detach().reshape(-1).cpu().float()
    if indices.numel() != values.numel():
        raise ValueError(f"{indices.numel()} indices but {values.numel()} values.")
    if indices.numel() > numel:
        raise ValueError(f"{indices.numel()} entries exceed numel {numel}.")
    _check_indices(indices, numel, "encode_sparse")
    if not bool(torch.isfinite(values).all()):
        raise ValueError("encode_sparse: values contain NaN or Inf.")
    bits = index_bits(numel)
    parts = [_u32(indices.numel()), _pack_idx(indices, bits), codecs.pack_values(values, encoding)]
    return torch.cat(parts)


def _check_low_bit_values(raw: torch.Tensor, count: int, encoding: str, what: str) -> None:
    per_byte = 8 if encoding == "sign" else 4
    width = 8 // per_byte
    body = raw[: (count + per_byte - 1) // per_byte]
    scale = raw[body.numel() :].clone().view(torch.float32)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError(f"{what}: scale must be finite and >= 0, got {scale.tolist()}.")
    shifts = torch.arange(per_byte, dtype=torch.int32) * width
    codes = ((body.to(torch.int32)[:, None] >> shifts) & ((1 << width) - 1)).reshape(-1)
    if bool((codes[count:] != 0).any()):
        raise ValueError(f"{what}: non-zero padding bits.")
    if encoding == "ternary" and bool((codes == 3).any()):
        raise ValueError(f"{what}: invalid ternary code 3.")


def decode_sparse(data: torch.Tensor, numel: int, encoding: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
    """Decode and validate :func:`encode_sparse` bytes.

    Returns:
        ``(indices int64 ascending, values float32)``.

    Raises:
        ValueError: Any malformed input (see the module docstring); nothing is returned for it.
    """
    encoding = codecs.validate_value_encoding(encoding)
    data = _check_bytes(data, "sparse message")
    count, bits = read_count(data), index_bits(numel)
    _check_length(data, count, numel, sparse_message_nbytes(count, numel, encoding), "sparse message")
    split = HEADER_BYTES + _index_nbytes(count, bits)
    indices = _unpack_idx(data[HEADER_BYTES:split], count, bits)
    _check_indices(indices, numel, "sparse message")
    raw = data[split:]
    if encoding in ("sign", "ternary") and count:
        _check_low_bit_values(raw, count, encoding, "sparse message")
    values = codecs.unpack_values(raw, 1 if count else 0, count if count else 0, encoding).reshape(-1)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("sparse message: values contain NaN or Inf.")
    return indices, values


# ------------------------------------------------------------------------------------------------- flip sets
def encode_flips(indices: torch.Tensor, directions: torch.Tensor, numel: int) -> torch.Tensor:
    """Encode a flip set (indices strictly increasing, directions in ``{-1, +1}``) as ``uint8`` bytes."""
    indices, directions = indices.reshape(-1).cpu().long(), directions.reshape(-1).cpu().to(torch.int64)
    if indices.numel() != directions.numel():
        raise ValueError(f"{indices.numel()} indices but {directions.numel()} directions.")
    _check_indices(indices, numel, "encode_flips")
    if indices.numel() > numel or not bool((directions.abs() == 1).all()):
        raise ValueError("encode_flips: directions must be -1 or +1 and count <= numel.")
    bits = (directions < 0).to(torch.int64)
    pad = (-bits.numel()) % 8
    bits = torch.cat((bits, bits.new_zeros(pad))).view(-1, 8)
    body = (bits << torch.arange(8)).sum(dim=1).to(torch.uint8)
    return torch.cat((_u32(indices.numel()), _pack_idx(indices, index_bits(numel)), body))


def decode_flips(data: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode and validate :func:`encode_flips` bytes into ``(indices int64, directions int8)``."""
    data = _check_bytes(data, "flip message")
    count, bits = read_count(data), index_bits(numel)
    _check_length(data, count, numel, flip_message_nbytes(count, numel), "flip message")
    split = HEADER_BYTES + _index_nbytes(count, bits)
    indices = _unpack_idx(data[HEADER_BYTES:split], count, bits)
    _check_indices(indices, numel, "flip message")
    flags = ((data[split:].to(torch.int64)[:, None] >> torch.arange(8)) & 1).reshape(-1)
    if bool((flags[count:] != 0).any()):
        raise ValueError("flip message: non-zero padding bits.")
    return indices, (1 - 2 * flags[:count]).to(torch.int8)
