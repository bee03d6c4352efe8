"""Wire format of the sparse flip exchange: sparse gradient lists and flip sets as validated ``uint8`` bytes.

Messages are flat ``uint8`` tensors, little-endian, no pickle (``n = count``)::

    sparse list: count:u32 | index section | values        flip set: count:u32 | index section | direction bits

The index section depends on ``numel`` (and on ``count`` only through its length), so every size is an exact function
of ``(count, numel, encoding)`` and a receiver can size a body from the 4-byte header alone:

* ``numel <= 65536``: the indices at ``index_bits(numel)`` bits, 12 (``numel <= 4096``) or 16, in the
  :mod:`lightning_hetero.comm.payload_packing` layouts.
* ``numel > 65536``: the flat space is cut into ``B = ceil(numel / 65536)`` blocks of :data:`BLOCK` codes (the last
  one possibly partial). The section is a block-count table, ``B`` counts of :data:`BLOCK_COUNT_BITS` (17) bits packed
  LSB-first (bit ``j`` of count ``b`` is bit ``(17 b + j) % 8`` of byte ``(17 b + j) // 8``, zero-padded to a byte),
  then each entry's offset inside its block as a u16, entries in ascending global order (index ``= 65536 b + offset``).
  An empty list has no table: it is the 4-byte header ``0`` whatever ``numel``. So an index costs 16 bits plus
  ``17 B / 8`` bytes per list (26 bytes for 786,432 codes), instead of 32 bits.

Values use a codec value encoding (``fp32``, ``bf16``, ``sign``, ``ternary``; the last two with one fp32 scale for the
list). Direction bits: bit ``i % 8`` of byte ``i // 8`` set means ``-1``. Decoders reject with a ValueError any wrong
length, count above ``numel``, block count above its block's size or block counts not summing to ``count``, index out
of range or not strictly increasing (within a block: offsets strictly increasing and inside the block), non-canonical
padding, invalid ternary code, NaN/Inf value, a value or scale of magnitude above
:data:`~lightning_hetero.comm.validation.MAX_PEER_MAGNITUDE`, or a negative / non-finite scale: nothing is ever
applied silently. They raise :class:`~lightning_hetero.comm.validation.PeerPayloadError` (a ``ValueError``) naming the
sending rank and the field (``bytes``, ``count``, ``length``, ``index_table``, ``indices``, ``values``, ``scale``,
``padding``, ``directions``); nothing else escapes them (the peer-payload rule of docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from lightning_hetero.comm import payload_packing
from lightning_hetero.comm.validation import PeerPayloadError, check_values, peer_decoding

__all__ = [
    "BLOCK",
    "BLOCK_COUNT_BITS",
    "HEADER_BYTES",
    "decode_flips",
    "decode_sparse",
    "encode_flips",
    "encode_sparse",
    "flip_message_nbytes",
    "index_bits",
    "index_section_nbytes",
    "num_blocks",
    "read_count",
    "sparse_message_nbytes",
]

HEADER_BYTES = 4
BLOCK = 65536
"""Codes per block of the blocked index layout (``numel > BLOCK``); an offset inside a block fits a u16."""
BLOCK_COUNT_BITS = 17
"""Bits per entry of the block-count table: a count is in ``[0, BLOCK]``."""
_MAX_NUMEL = 2**32 - 1
_T = TypeVar("_T")


class _Invalid(ValueError):
    """A malformed message or argument, with the field that is wrong (decoders turn it into a PeerPayloadError)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


# ------------------------------------------------------------------------------------------------- layouts
def index_bits(numel: int) -> int:
    """Bits per index entry for a flat space of ``numel`` codes: 12 (``numel <= 4096``) or 16.

    Above :data:`BLOCK` codes the 16 bits are an offset inside a block and the section also holds the block-count
    table (see :func:`index_section_nbytes`).

    Raises:
        ValueError: ``numel`` outside ``[0, 2**32)``.
    """
    if numel < 0 or numel > _MAX_NUMEL:
        raise ValueError(f"numel must be in [0, 2**32), got {numel}.")
    return 12 if numel <= 4096 else 16


def num_blocks(numel: int) -> int:
    """Blocks of the blocked index layout for ``numel`` codes: 0 when ``numel <= BLOCK`` (flat layout)."""
    index_bits(numel)
    return 0 if numel <= BLOCK else -(-numel // BLOCK)


def _table_nbytes(count: int, numel: int) -> int:
    return 0 if count == 0 else (num_blocks(numel) * BLOCK_COUNT_BITS + 7) // 8


def index_section_nbytes(count: int, numel: int) -> int:
    """Exact size in bytes of the index section of ``count`` entries (block-count table included)."""
    return _table_nbytes(count, numel) + payload_packing.index_nbytes(count, index_bits(numel))


def _value_nbytes(count: int, encoding: str) -> int:
    return payload_packing.value_nbytes(count, encoding, rows=1 if count else 0)


def sparse_message_nbytes(count: int, numel: int, encoding: str = "bf16") -> int:
    """Exact size of an encoded sparse list of ``count`` entries over ``numel`` codes."""
    return HEADER_BYTES + index_section_nbytes(count, numel) + _value_nbytes(count, encoding)


def flip_message_nbytes(count: int, numel: int) -> int:
    """Exact size of an encoded flip set of ``count`` moves over ``numel`` codes."""
    return HEADER_BYTES + index_section_nbytes(count, numel) + (count + 7) // 8


def _u32(value: int) -> torch.Tensor:
    return torch.tensor([(value >> s) & 0xFF for s in (0, 8, 16, 24)], dtype=torch.uint8)


def read_count(data: torch.Tensor) -> int:
    """The little-endian u32 count in the first 4 bytes of a message."""
    return sum(int(b) << s for b, s in zip(data[:4].tolist(), (0, 8, 16, 24), strict=True))


def _pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative ``values`` (< ``2**width``) at ``width`` bits each, LSB-first, zero-padded to whole bytes."""
    bits = ((values.reshape(-1).to(torch.int64)[:, None] >> torch.arange(width)) & 1).reshape(-1)
    bits = torch.cat((bits, bits.new_zeros((-bits.numel()) % 8))).view(-1, 8)
    return (bits << torch.arange(8)).sum(dim=1).to(torch.uint8)


def _unpack_bits(data: torch.Tensor, n: int, width: int, what: str, field: str) -> torch.Tensor:
    """Inverse of :func:`_pack_bits` for ``n`` values; raises a ValueError (``field``) if a padding bit is set."""
    bits = ((data.reshape(-1).to(torch.int64)[:, None] >> torch.arange(8)) & 1).reshape(-1)
    if bool((bits[n * width :] != 0).any()):
        raise _Invalid(f"{what}: non-zero padding bits.", field)
    return (bits[: n * width].view(n, width) << torch.arange(width)).sum(dim=1)


def _block_sizes(numel: int) -> torch.Tensor:
    blocks = num_blocks(numel)
    sizes = torch.full((blocks,), BLOCK, dtype=torch.int64)
    if blocks:
        sizes[-1] = numel - BLOCK * (blocks - 1)
    return sizes


def _pack_idx(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Index section of validated ``indices`` (strictly increasing, in ``[0, numel)``)."""
    bits = index_bits(numel)
    if numel <= BLOCK or indices.numel() == 0:
        return payload_packing.pack_indices(indices, bits)
    table = torch.bincount(indices >> 16, minlength=num_blocks(numel))
    return torch.cat((_pack_bits(table, BLOCK_COUNT_BITS), payload_packing.pack_indices(indices & (BLOCK - 1), 16)))


def _unpack_idx(data: torch.Tensor, count: int, numel: int, what: str) -> torch.Tensor:
    """Indices of an index section of ``index_section_nbytes(count, numel)`` bytes, block table validated.

    The caller still checks the global order and range (:func:`_check_indices`): since an offset is < ``BLOCK``,
    global indices are strictly increasing and ``< numel`` exactly when every block's offsets are strictly increasing
    and inside the block.
    """
    bits = index_bits(numel)
    split = _table_nbytes(count, numel)
    if split:
        table = _unpack_bits(
            data[:split], num_blocks(numel), BLOCK_COUNT_BITS, f"{what} block-count table", "index_table"
        )
        sizes = _block_sizes(numel)
        over = (table > sizes).nonzero().reshape(-1)
        if over.numel():
            b = int(over[0])
            raise _Invalid(
                f"{what}: block {b} holds {int(table[b])} entries, more than its {int(sizes[b])} codes.", "index_table"
            )
        if int(table.sum()) != count:
            raise _Invalid(f"{what}: block counts sum to {int(table.sum())}, the header says {count}.", "index_table")
    body = data[split:]
    indices = payload_packing.unpack_indices(body, count, bits)
    if bits == 12 and not torch.equal(payload_packing.pack_indices(indices, bits), body):
        raise _Invalid(f"{what}: non-canonical index encoding (padding bits set).", "indices")
    if split:
        blocks = torch.repeat_interleave(torch.arange(table.numel(), dtype=torch.int64), table)
        indices = blocks * BLOCK + indices
    return indices


def _check_bytes(data: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise _Invalid(
            f"{what} must be a uint8 tensor, got {type(data).__name__} {getattr(data, 'dtype', '')}.", "bytes"
        )
    data = data.reshape(-1).cpu()
    if data.numel() < HEADER_BYTES:
        raise _Invalid(f"{what} is {data.numel()} bytes, shorter than its {HEADER_BYTES}-byte header.", "length")
    return data


def _check_indices(indices: torch.Tensor, numel: int, what: str) -> None:
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
        raise _Invalid(f"{what}: index out of range [0, {numel}).", "indices")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise _Invalid(f"{what}: indices must be strictly increasing.", "indices")


def _check_length(data: torch.Tensor, count: int, numel: int, expected: int, what: str) -> None:
    if count > numel:
        raise _Invalid(f"{what}: count {count} exceeds numel {numel}.", "count")
    if data.numel() != expected:
        raise _Invalid(f"{what}: {data.numel()} bytes, expected {expected} for {count} entries.", "length")


def encode_sparse(indices: torch.Tensor, values: torch.Tensor, numel: int, encoding: str = "bf16") -> torch.Tensor:
    """Encode a sparse list (indices strictly increasing, in ``[0, numel)``) as ``uint8`` bytes.

    Raises:
        ValueError: Bad indices, mismatched lengths or non-finite values.
    """
    encoding = payload_packing.validate_value_encoding(encoding)
    indices, values = indices.reshape(-1).cpu().long(), values.detach().reshape(-1).cpu().float()
    if indices.numel() != values.numel():
        raise ValueError(f"{indices.numel()} indices but {values.numel()} values.")
    if indices.numel() > numel:
        raise ValueError(f"{indices.numel()} entries exceed numel {numel}.")
    _check_indices(indices, numel, "encode_sparse")
    if not bool(torch.isfinite(values).all()):
        raise ValueError("encode_sparse: values contain NaN or Inf.")
    parts = [_u32(indices.numel()), _pack_idx(indices, numel), payload_packing.pack_values(values, encoding)]
    return torch.cat(parts)


def _check_low_bit_values(raw: torch.Tensor, count: int, encoding: str, what: str) -> None:
    per_byte = 8 if encoding == "sign" else 4
    width = 8 // per_byte
    body = raw[: (count + per_byte - 1) // per_byte]
    scale = raw[body.numel() :].clone().view(torch.float32)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise _Invalid(f"{what}: scale must be finite and >= 0, got {scale.tolist()}.", "scale")
    check_values(scale, what="scale")  # the decoded values are +-scale: bound it like a value
    shifts = torch.arange(per_byte, dtype=torch.int32) * width
    codes = ((body.to(torch.int32)[:, None] >> shifts) & ((1 << width) - 1)).reshape(-1)
    if bool((codes[count:] != 0).any()):
        raise _Invalid(f"{what}: non-zero padding bits.", "padding")
    if encoding == "ternary" and bool((codes == 3).any()):
        raise _Invalid(f"{what}: invalid ternary code 3.", "values")


def _decoded(what: str, peer: int | None, decode: Callable[[], _T]) -> _T:
    """``decode()``, with every error it raises turned into a PeerPayloadError naming ``peer`` and the field."""
    source = what if peer is None else f"{what} from rank {peer}"
    try:
        with peer_decoding(None, "payload"):  # an unexpected error (a tensor view, an allocation) is refused too
            try:
                return decode()
            except _Invalid as error:
                raise PeerPayloadError(str(error), None, error.field) from None
    except PeerPayloadError as error:
        raise PeerPayloadError(f"{source} refused: {error}", peer, error.field or "payload") from error.__cause__


def decode_sparse(
    data: torch.Tensor, numel: int, encoding: str = "bf16", *, peer: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode and validate :func:`encode_sparse` bytes.

    Args:
        data: The message (``uint8``).
        numel: Codes of the flat space the indices address.
        encoding: Value encoding the sender used.
        peer: The sending rank, named in the error.

    Returns:
        ``(indices int64 ascending, values float32)``.

    Raises:
        PeerPayloadError: Any malformed input (see the module docstring); nothing is returned for it.
    """
    encoding = payload_packing.validate_value_encoding(encoding)
    index_bits(numel)  # a bad local numel is the caller's ValueError, not the peer's
    return _decoded("sparse message", peer, lambda: _decode_sparse(data, numel, encoding))


def _decode_sparse(data: torch.Tensor, numel: int, encoding: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = _check_bytes(data, "sparse message")
    count = read_count(data)
    _check_length(data, count, numel, sparse_message_nbytes(count, numel, encoding), "sparse message")
    split = HEADER_BYTES + index_section_nbytes(count, numel)
    indices = _unpack_idx(data[HEADER_BYTES:split], count, numel, "sparse message")
    _check_indices(indices, numel, "sparse message")
    raw = data[split:]
    if encoding in ("sign", "ternary") and count:
        _check_low_bit_values(raw, count, encoding, "sparse message")
    values = payload_packing.unpack_values(raw, 1 if count else 0, count if count else 0, encoding).reshape(-1)
    if not bool(torch.isfinite(values).all()):
        raise _Invalid("sparse message: values contain NaN or Inf.", "values")
    check_values(values, what="values")  # finite alone is not enough: 3e38 + 3e38 overflows a sum of lists
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
    body = _pack_bits((directions < 0).to(torch.int64), 1)
    return torch.cat((_u32(indices.numel()), _pack_idx(indices, numel), body))


def decode_flips(data: torch.Tensor, numel: int, *, peer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode and validate :func:`encode_flips` bytes into ``(indices int64, directions int8)``.

    Raises:
        PeerPayloadError: Any malformed input (``peer``, the sending rank, is named in the message).
    """
    index_bits(numel)
    return _decoded("flip message", peer, lambda: _decode_flips(data, numel))


def _decode_flips(data: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = _check_bytes(data, "flip message")
    count = read_count(data)
    _check_length(data, count, numel, flip_message_nbytes(count, numel), "flip message")
    split = HEADER_BYTES + index_section_nbytes(count, numel)
    indices = _unpack_idx(data[HEADER_BYTES:split], count, numel, "flip message")
    _check_indices(indices, numel, "flip message")
    flags = _unpack_bits(data[split:], count, 1, "flip message", "directions")
    return indices, (1 - 2 * flags).to(torch.int8)
