"""Bit-packing codecs for sparse / quantized payloads: indices to 12 or 16 bits, values to fp32, bf16, sign or ternary.

Everything packs into flat ``uint8`` tensors so that a whole bucket of parameters can travel in one
``all_gather_into_tensor`` (the counted wrappers move uint8 natively on gloo and NCCL). Byte counts are exact and
known in advance from the element counts alone (:func:`index_nbytes`, :func:`value_nbytes`), which is what lets every
replica slice a gathered buffer without sending any header and lets ``payload_bytes`` be an analytic formula.

Layouts (all little-endian, element ``i`` before element ``i + 1``):

- **16-bit indices**: two bytes per index, low byte first. ``2 * count`` bytes; indices must lie in ``[0, 65536)``.
- **12-bit indices**: two indices ``a, b`` in three bytes ``a & 0xFF``, ``(a >> 8) | (b & 0xF) << 4``, ``b >> 4``.
  An odd count ends with a lone index in two bytes (its third byte would always be zero, so it is not sent):
  ``ceil(3 * count / 2)`` bytes; indices must lie in ``[0, 4096)``.
- **fp32 / bf16 values**: the raw IEEE bytes, ``4 * count`` / ``2 * count``.
- **sign values** (1 bit): bit ``i % 8`` of byte ``i // 8`` is 1 for a negative value, then one fp32 scale per row.
  The receiver sees ``scale_row * (+1 | -1)`` with ``scale_row = mean(|v|)`` over the row (the L2-optimal scale for
  a sign code). Zero maps to ``+scale`` (one bit cannot say "zero"; use ternary where zeros matter).
  ``ceil(count / 8) + 4 * rows`` bytes.
- **ternary values** (2 bits): code 0 = 0, 1 = +1, 2 = -1, four codes per byte (bits ``2*(i % 4)``), then one fp32
  scale per row. A value is coded non-zero when ``|v| >= 0.5 * mean(|v|)`` of its row; the row's scale is then the
  mean ``|v|`` of its non-zero codes (L2-optimal for the chosen codes). ``ceil(count / 4) + 4 * rows`` bytes.

"Rows" are the caller's scale groups: one per DCT chunk for the DeMo replicator, one per tensor for the dense ones.
Values are passed as a 2-D ``(rows, cols)`` tensor (a 1-D tensor is one row).

Bytes from another process go through :func:`unpack_peer_indices` / :func:`unpack_peer_values` instead: they keep
the decoder rule of :mod:`lightning_hetero.comm.validation` (exact length, canonical padding, indices in range and
unique per row, ternary codes in ``{0, 1, 2}``, scales finite, ``>= 0`` and bounded, values finite and of magnitude
at most :data:`~lightning_hetero.comm.validation.MAX_PEER_MAGNITUDE`) or raise
:class:`~lightning_hetero.comm.validation.PeerPayloadError` naming the peer and the field. :func:`unpack_indices` and
:func:`unpack_values` trust their input (a rank's own bytes).
"""

from __future__ import annotations

import torch

from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError, peer_decoding

__all__ = [
    "INDEX_BITS",
    "VALUE_ENCODINGS",
    "dequantize_values",
    "index_nbytes",
    "pack_indices",
    "pack_values",
    "unpack_indices",
    "unpack_peer_indices",
    "unpack_peer_values",
    "unpack_values",
    "validate_index_bits",
    "validate_value_encoding",
    "value_nbytes",
]

INDEX_BITS: tuple[int, ...] = (12, 16)
"""Supported index widths."""
VALUE_ENCODINGS: tuple[str, ...] = ("fp32", "bf16", "sign", "ternary")
"""Supported value encodings."""

_SCALE_BYTES = 4  # one fp32 scale per row for sign / ternary
_SIGN_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


# ------------------------------------------------------------------------------------------------- validation
def validate_index_bits(index_bits: object) -> int:
    """Return ``index_bits`` if it is 12 or 16, else raise a ValueError naming the valid values."""
    if isinstance(index_bits, bool) or index_bits not in INDEX_BITS:
        raise ValueError(f"index_bits must be one of {list(INDEX_BITS)}, got {index_bits!r}.")
    return int(index_bits)  # type: ignore[arg-type]


def validate_value_encoding(values: object) -> str:
    """Return ``values`` if it is a known encoding, else raise a ValueError naming the valid values."""
    if values not in VALUE_ENCODINGS:
        raise ValueError(f"values must be one of {list(VALUE_ENCODINGS)}, got {values!r}.")
    return str(values)


def _check_count(count: int, what: str) -> None:
    if count < 0:
        raise ValueError(f"{what} must be >= 0, got {count}.")


# ------------------------------------------------------------------------------------------------- byte counts
def index_nbytes(count: int, bits: int) -> int:
    """Exact packed size in bytes of ``count`` indices at ``bits`` (12 or 16) bits each."""
    _check_count(count, "count")
    bits = validate_index_bits(bits)
    return 2 * count if bits == 16 else (3 * count + 1) // 2


def value_nbytes(count: int, encoding: str, rows: int = 1) -> int:
    """Exact packed size in bytes of ``count`` values in ``rows`` scale groups under ``encoding``.

    Args:
        count: Number of values (all rows together).
        encoding: One of :data:`VALUE_ENCODINGS`.
        rows: Scale groups (only sign / ternary send one fp32 scale per row).
    """
    _check_count(count, "count")
    _check_count(rows, "rows")
    encoding = validate_value_encoding(encoding)
    if encoding == "fp32":
        return 4 * count
    if encoding == "bf16":
        return 2 * count
    per_byte = 8 if encoding == "sign" else 4
    return (count + per_byte - 1) // per_byte + _SCALE_BYTES * rows


# ------------------------------------------------------------------------------------------------------ indices
def pack_indices(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integer ``indices`` (any shape, flattened) into ``index_nbytes(numel, bits)`` uint8 bytes.

    The range is not checked here (that would synchronise a GPU); callers validate the block size up front.
    """
    bits = validate_index_bits(bits)
    flat = indices.reshape(-1).to(torch.int32)
    count = flat.numel()
    if bits == 16:
        out = torch.stack((flat & 0xFF, flat >> 8), dim=1)
        return out.reshape(-1).to(torch.uint8)
    if count % 2:
        flat = torch.cat((flat, flat.new_zeros(1)))
    a, b = flat[0::2], flat[1::2]
    out = torch.stack((a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4), dim=1).reshape(-1).to(torch.uint8)
    return out[: index_nbytes(count, 12)]


def unpack_indices(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_indices`: ``count`` int64 indices from the first ``index_nbytes(count, bits)`` bytes."""
    bits = validate_index_bits(bits)
    nbytes = index_nbytes(count, bits)
    raw = data.reshape(-1)[:nbytes]
    if raw.numel() != nbytes:
        raise ValueError(f"need {nbytes} bytes for {count} {bits}-bit indices, got {raw.numel()}.")
    raw = raw.to(torch.int64)
    if bits == 16:
        pairs = raw.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 8)
    if count % 2:
        raw = torch.cat((raw, raw.new_zeros(1)))
    triples = raw.view(-1, 3)
    a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    return torch.stack((a, b), dim=1).reshape(-1)[:count]


# ------------------------------------------------------------------------------------------------------- values
def _as_rows(values: torch.Tensor) -> torch.Tensor:
    if values.dim() == 1:
        return values.reshape(1, -1) if values.numel() else values.reshape(0, 0)
    if values.dim() != 2:
        raise ValueError(f"values must be 1-D or 2-D (rows, cols), got shape {tuple(values.shape)}.")
    return values


def _sign_scale(rows: torch.Tensor) -> torch.Tensor:
    if rows.shape[1] == 0:
        return rows.new_zeros(rows.shape[0])
    return rows.abs().mean(dim=1)


def _ternary_codes_and_scale(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes in {-1, 0, +1} and the per-row L2-optimal scale for them."""
    magnitude = rows.abs()
    mean = magnitude.mean(dim=1, keepdim=True) if rows.shape[1] else magnitude.new_zeros(rows.shape[0], 1)
    nonzero = (magnitude >= 0.5 * mean) & (magnitude > 0)
    codes = torch.where(nonzero, torch.sign(rows), torch.zeros_like(rows))
    kept = nonzero.sum(dim=1)
    scale = torch.where(nonzero, magnitude, torch.zeros_like(magnitude)).sum(dim=1) / kept.clamp(min=1)
    return codes, scale


def dequantize_values(values: torch.Tensor, encoding: str) -> torch.Tensor:
    """What a receiver decodes for ``values`` (float32, same shape): the exact round trip of pack/unpack."""
    encoding = validate_value_encoding(encoding)
    values = values.float()
    if encoding == "fp32":
        return values.clone()
    if encoding == "bf16":
        return values.to(torch.bfloat16).float()
    rows = _as_rows(values)
    if encoding == "sign":
        signs = torch.where(rows < 0, -torch.ones_like(rows), torch.ones_like(rows))
        return (signs * _sign_scale(rows)[:, None]).reshape(values.shape)
    codes, scale = _ternary_codes_and_scale(rows)
    return (codes * scale[:, None]).reshape(values.shape)


def _pack_bits(codes: torch.Tensor, per_byte: int) -> torch.Tensor:
    """Pack small non-negative integer codes (``8 // per_byte`` bits each) into bytes, first code in the low bits."""
    flat = codes.reshape(-1).to(torch.int32)
    pad = (-flat.numel()) % per_byte
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    width = 8 // per_byte
    shifts = torch.arange(per_byte, device=flat.device, dtype=torch.int32) * width
    return (flat.view(-1, per_byte) << shifts).sum(dim=1).to(torch.uint8)


def _unpack_bits(data: torch.Tensor, count: int, per_byte: int) -> torch.Tensor:
    width = 8 // per_byte
    shifts = torch.arange(per_byte, device=data.device, dtype=torch.int32) * width
    codes = (data.to(torch.int32)[:, None] >> shifts) & ((1 << width) - 1)
    return codes.reshape(-1)[:count]


def pack_values(values: torch.Tensor, encoding: str) -> torch.Tensor:
    """Pack ``values`` (1-D = one row, or 2-D ``(rows, cols)``) into ``value_nbytes(numel, encoding, rows)`` bytes."""
    encoding = validate_value_encoding(encoding)
    values = values.detach()
    if encoding == "fp32":
        return values.float().contiguous().reshape(-1).view(torch.uint8)
    if encoding == "bf16":
        return values.to(torch.bfloat16).contiguous().reshape(-1).view(torch.uint8)
    rows = _as_rows(values.float())
    if encoding == "sign":
        body = _pack_bits((rows < 0).to(torch.int32), 8)
        scale = _sign_scale(rows)
    else:
        codes, scale = _ternary_codes_and_scale(rows)
        body = _pack_bits(torch.where(codes < 0, 2, codes.to(torch.int32)), 4)
    return torch.cat((body, scale.float().contiguous().view(torch.uint8)))


def unpack_values(data: torch.Tensor, rows: int, cols: int, encoding: str) -> torch.Tensor:
    """Inverse of :func:`pack_values`: a float32 ``(rows, cols)`` tensor from the first packed bytes of ``data``."""
    encoding = validate_value_encoding(encoding)
    count = rows * cols
    nbytes = value_nbytes(count, encoding, rows)
    raw = data.reshape(-1)[:nbytes]
    if raw.numel() != nbytes:
        raise ValueError(f"need {nbytes} bytes for {rows}x{cols} {encoding} values, got {raw.numel()}.")
    if encoding in ("fp32", "bf16"):
        dtype = torch.float32 if encoding == "fp32" else torch.bfloat16
        return raw.clone().view(dtype).float().reshape(rows, cols)
    per_byte = 8 if encoding == "sign" else 4
    body_bytes = nbytes - _SCALE_BYTES * rows
    scale = raw[body_bytes:].clone().view(torch.float32)
    codes = _unpack_bits(raw[:body_bytes], count, per_byte).reshape(rows, cols)
    if encoding == "sign":
        unit = 1.0 - 2.0 * codes.float()  # bit 1 = negative
    else:
        unit = torch.where(codes == 2, -1.0, codes.float())
    return unit * scale[:, None]


# ------------------------------------------------------------------------------------------------- peer bytes
def _sender(peer: int | None, sender: str | None) -> str:
    if sender is not None:
        return sender
    return f"rank {peer}" if peer is not None else "a peer"


def _check_peer_bytes(data: torch.Tensor, nbytes: int, who: str, where: str, peer: int | None, what: str) -> None:
    """Refuse anything but a uint8 tensor of exactly ``nbytes`` bytes (the size the receiver's own layout gives)."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise PeerPayloadError(
            f"{who} sent {type(data).__name__} {getattr(data, 'dtype', '')}{where} (field {what}), not uint8 bytes;"
            " refusing it.",
            peer,
            what,
        )
    if data.numel() != nbytes:
        raise PeerPayloadError(
            f"{who} sent {data.numel()} bytes{where} (field {what}), expected {nbytes} (truncated, padded or built by a"
            " differently configured peer); refusing it.",
            peer,
            what,
        )


def unpack_peer_indices(
    data: torch.Tensor,
    count: int,
    bits: int,
    *,
    limit: int,
    rows: int = 1,
    peer: int | None = None,
    what: str = "indices",
    sender: str | None = None,
    where: str = "",
) -> torch.Tensor:
    """:func:`unpack_indices` for bytes another process sent, validated by the decoder rule.

    Args:
        data: Exactly ``index_nbytes(count, bits)`` uint8 bytes.
        count: Indices expected (from the receiver's own layout, never from the peer).
        bits: 12 or 16 (the receiver's own configuration).
        limit: Every index must lie in ``[0, limit)``.
        rows: The indices form ``rows`` equal rows (e.g. one per DCT block) and may not repeat within a row (a
            repeat would be applied twice, or ambiguously); 0 allows repeats.
        peer: The sending rank, carried by the error (``PeerPayloadError.peer``).
        what: The field, carried by the error (``PeerPayloadError.field``).
        sender: How the message names the sender (default ``"rank <peer>"``).
        where: Appended to the field in the message (e.g. ``" for parameter piece 3"``).

    Raises:
        PeerPayloadError: Wrong length or type, non-zero padding bits, an index out of range or repeated in its row.
    """
    bits = validate_index_bits(bits)  # the receiver's own configuration: a plain ValueError when wrong
    nbytes = index_nbytes(count, bits)
    if rows and count % rows:
        raise ValueError(f"unpack_peer_indices: {count} indices do not form {rows} equal rows.")
    who = _sender(peer, sender)
    with peer_decoding(peer, what):
        _check_peer_bytes(data, nbytes, who, where, peer, what)
        raw = data.reshape(-1)
        indices = unpack_indices(raw, count, bits)
        if not count:
            return indices
        # Every check as one device flag, read once (a host sync per check would stall a GPU once per rank and piece).
        bad = indices.max() >= limit  # unpacked indices are never negative
        if bits == 12 and count % 2:
            bad = bad | (raw[-1] >> 4 != 0)  # the lone last index's unused high nibble
        ordered = indices.view(rows, count // rows).sort(dim=1).values if rows and count > rows else None
        if ordered is not None:
            bad = bad | (ordered[:, 1:] == ordered[:, :-1]).any()
        if bool(bad):
            _refuse_indices(raw, indices, ordered, bits, limit, who, where, peer, what)
    return indices


def _refuse_indices(
    raw: torch.Tensor,
    indices: torch.Tensor,
    ordered: torch.Tensor | None,
    bits: int,
    limit: int,
    who: str,
    where: str,
    peer: int | None,
    what: str,
) -> None:
    """Raise the :class:`PeerPayloadError` that says which index check failed (only called when one did)."""
    if bits == 12 and indices.numel() % 2 and int(raw[-1]) >> 4:
        raise PeerPayloadError(f"{who} sent non-zero padding bits{where} (field {what}); refusing them.", peer, what)
    if int(indices.max()) >= limit:
        raise PeerPayloadError(
            f"{who} sent index {int(indices.max())}{where} (field {what}), outside [0, {limit}); refusing to apply it.",
            peer,
            what,
        )
    raise PeerPayloadError(
        f"{who} sent a row that repeats an index{where} (field {what}); refusing to apply it.", peer, what
    )


def unpack_peer_values(
    data: torch.Tensor,
    rows: int,
    cols: int,
    encoding: str,
    *,
    peer: int | None = None,
    what: str = "values",
    sender: str | None = None,
    where: str = "",
    bound: float = MAX_PEER_MAGNITUDE,
) -> torch.Tensor:
    """:func:`unpack_values` for bytes another process sent, validated by the decoder rule.

    Args:
        data: Exactly ``value_nbytes(rows * cols, encoding, rows)`` uint8 bytes.
        rows: Scale groups (from the receiver's own layout).
        cols: Values per row.
        encoding: One of :data:`VALUE_ENCODINGS` (the receiver's own configuration).
        peer: The sending rank, carried by the error (``PeerPayloadError.peer``).
        what: The field (``PeerPayloadError.field``); sign/ternary sub-fields are ``<what>.scale``,
            ``<what>.codes`` and ``<what>.padding``.
        sender: How the message names the sender (default ``"rank <peer>"``).
        where: Appended to the field in the message (e.g. ``" for parameter piece 3"``).
        bound: Largest accepted magnitude of a value or scale.

    Raises:
        PeerPayloadError: Wrong length or type; a NaN/Inf, negative or too large scale (sign/ternary); a ternary
            code 3; non-zero padding bits; a non-finite value or one above ``bound``.
    """
    encoding = validate_value_encoding(encoding)
    count = rows * cols
    nbytes = value_nbytes(count, encoding, rows)
    who = _sender(peer, sender)
    with peer_decoding(peer, what):
        _check_peer_bytes(data, nbytes, who, where, peer, what)
        raw = data.reshape(-1)
        values = unpack_values(raw, rows, cols, encoding)
        if not nbytes:
            return values
        # One device flag for every check, read once; NaN fails every comparison, so "<= bound" also refuses it.
        bad = ~(values.abs() <= bound).all()
        low_bit = encoding in ("sign", "ternary")
        if low_bit:
            scale, codes = _scale_and_codes(raw, rows, encoding)
            bad = bad | ~((scale >= 0) & (scale <= bound)).all() | (codes[count:] != 0).any() | (codes == 3).any()
        if bool(bad):
            if low_bit:
                _refuse_low_bit(raw, rows, count, encoding, who, where, peer, what, bound)
            _refuse_values(values, who, where, peer, what, bound)
    return values


def _scale_and_codes(raw: torch.Tensor, rows: int, encoding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 scales and every 1- or 2-bit code of a sign/ternary payload (padding codes included)."""
    per_byte = 8 if encoding == "sign" else 4
    body_bytes = raw.numel() - _SCALE_BYTES * rows
    scale = raw[body_bytes:].clone().view(torch.float32)
    return scale, _unpack_bits(raw[:body_bytes], body_bytes * per_byte, per_byte)


def _refuse_values(values: torch.Tensor, who: str, where: str, peer: int | None, what: str, bound: float) -> None:
    """Raise the :class:`PeerPayloadError` for non-finite or too large values (only called when there are some)."""
    if not bool(torch.isfinite(values).all()):
        raise PeerPayloadError(
            f"{who} sent non-finite values{where} (field {what}); refusing to apply them (a diverged or corrupt peer:"
            " check its loss, or restart from the last checkpoint).",
            peer,
            what,
        )
    raise PeerPayloadError(
        f"{who} sent a value of magnitude {float(values.abs().max()):.3g}{where} (field {what}), above the bound"
        f" {bound:.3g} that no healthy run reaches; refusing to apply it (a corrupt or hostile peer).",
        peer,
        what,
    )


def _refuse_low_bit(
    raw: torch.Tensor,
    rows: int,
    count: int,
    encoding: str,
    who: str,
    where: str,
    peer: int | None,
    what: str,
    bound: float,
) -> None:
    """Raise for a NaN/Inf, negative or too large scale, non-zero padding bits or a ternary code 3, if any."""
    scale, codes = _scale_and_codes(raw, rows, encoding)
    field = f"{what}.scale"
    if not bool(torch.isfinite(scale).all()):
        raise PeerPayloadError(
            f"{who} sent non-finite values: a NaN/Inf scale{where} (field {field}); refusing it.", peer, field
        )
    if bool((scale < 0).any()):
        raise PeerPayloadError(
            f"{who} sent a negative scale {float(scale.min()):.3g}{where} (field {field}; an honest scale is a mean"
            " magnitude, >= 0); refusing it.",
            peer,
            field,
        )
    if float(scale.max()) > bound:
        raise PeerPayloadError(
            f"{who} sent a scale of magnitude {float(scale.max()):.3g}{where} (field {field}), above the bound"
            f" {bound:.3g}; refusing it.",
            peer,
            field,
        )
    if bool((codes[count:] != 0).any()):
        raise PeerPayloadError(
            f"{who} sent non-zero padding bits{where} (field {what}.padding); refusing them.", peer, f"{what}.padding"
        )
    if encoding == "ternary" and bool((codes == 3).any()):
        raise PeerPayloadError(
            f"{who} sent ternary code 3{where} (field {what}.codes; the codes are 0, 1 = +1 and 2 = -1); refusing it.",
            peer,
            f"{what}.codes",
        )
