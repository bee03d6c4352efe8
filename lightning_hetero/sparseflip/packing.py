"""Dense bit packing of ternary / binary codes, XOR + popcount matmuls, and packed safetensors checkpoints.

Code layouts (element ``i`` before ``i + 1``, first element in the low bits; the last byte is zero-padded):

- **2-bit ternary**: code ``0 -> 0``, ``+1 -> 1``, ``-1 -> 2`` (the
  :mod:`lightning_hetero.comm.payload_packing` ternary code), four per byte, ``ceil(n / 4)`` bytes.
- **base-3 ternary**: five trits per byte as ``sum_j (t_j + 1) * 3**j`` (at most 242), ``ceil(n / 5)`` bytes (1.6 bits
  per trit, 1.58 being the entropy bound); padding trits are 0 (digit 1).
- **1-bit binary**: bit set means ``-1`` (the seed's "+1 as an unset bit and -1 as a set bit"), ``ceil(n / 8)`` bytes.

Popcount matmul. With ``a, w`` in ``{-1, +1}^K`` stored as sign bits, ``a . w = K - 2 * popcount(a XOR w)``. For
a ternary ``w`` held as sign bits ``s`` and a non-zero mask ``m``:
``a . w = popcount(m) - 2 * popcount((a XOR s) AND m)``.
Rows are packed along the last dim into ``uint8`` or ``int64`` words (:func:`pack_signs`, :func:`pack_mask`; padding
bits are zero in both operands so they never count) and the result is exact integer arithmetic, equal to the float
matmul of the ``+/-1`` (and 0) matrices.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from torch import nn

from lightning_hetero.sparseflip.layers import lowbit_layers

__all__ = [
    "PACKED_FORMATS",
    "binary_matmul",
    "load_packed",
    "pack_binary",
    "pack_mask",
    "pack_signs",
    "pack_ternary_2bit",
    "pack_ternary_base3",
    "packed_matmul",
    "popcount",
    "save_packed",
    "ternary_matmul",
    "unpack_binary",
    "unpack_ternary_2bit",
    "unpack_ternary_base3",
]

PACKED_FORMATS: tuple[str, ...] = ("2bit", "base3")
"""Ternary checkpoint formats of :func:`save_packed` (binary codes are always 1 bit)."""

_POPCOUNT_LUT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)
_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int64)
_CHUNK_BYTES = 1 << 26


def _flat_codes(codes: torch.Tensor, allowed: tuple[int, ...]) -> torch.Tensor:
    flat = codes.detach().reshape(-1).cpu().to(torch.int64)
    bad = ~torch.isin(flat, torch.tensor(allowed))
    if bool(bad.any()):
        raise ValueError(f"codes must lie in {list(allowed)}, found {sorted(set(flat[bad].tolist()))[:5]}.")
    return flat


def _pack_fields(fields: torch.Tensor, per_byte: int) -> torch.Tensor:
    width = 8 // per_byte
    pad = (-fields.numel()) % per_byte
    fields = torch.cat((fields, fields.new_zeros(pad))).view(-1, per_byte)
    return (fields << (torch.arange(per_byte, device=fields.device) * width)).sum(dim=1).to(torch.uint8)


def _unpack_fields(data: torch.Tensor, count: int, per_byte: int, what: str) -> torch.Tensor:
    if data.dtype != torch.uint8 or data.numel() != (count + per_byte - 1) // per_byte:
        raise ValueError(f"{what}: need {(count + per_byte - 1) // per_byte} uint8 bytes for {count} codes.")
    width = 8 // per_byte
    shifts = torch.arange(per_byte, device=data.device) * width  # on the data's device: unpacking a CUDA buffer works
    fields = (data.reshape(-1).to(torch.int64)[:, None] >> shifts) & ((1 << width) - 1)
    fields = fields.reshape(-1)
    if bool((fields[count:] != 0).any()):
        raise ValueError(f"{what}: non-zero padding bits.")
    return fields[:count]


def pack_ternary_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack ternary codes (any shape, flattened) four per byte; see the module docstring for the layout."""
    flat = _flat_codes(codes, (-1, 0, 1))
    return _pack_fields(torch.where(flat < 0, 2, flat), 4)


def unpack_ternary_2bit(data: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary_2bit`: ``count`` int8 codes (ValueError on code 3, bad length or padding)."""
    fields = _unpack_fields(data, count, 4, "2-bit ternary")
    if bool((fields == 3).any()):
        raise ValueError("2-bit ternary: invalid code 3.")
    return torch.where(fields == 2, -1, fields).to(torch.int8)


def pack_ternary_base3(codes: torch.Tensor) -> torch.Tensor:
    """Pack ternary codes five per byte in base 3."""
    digits = _flat_codes(codes, (-1, 0, 1)) + 1
    pad = (-digits.numel()) % 5
    digits = torch.cat((digits, torch.ones(pad, dtype=torch.int64))).view(-1, 5)
    return (digits * _POW3).sum(dim=1).to(torch.uint8)


def unpack_ternary_base3(data: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary_base3` (ValueError on a byte above 242, bad length or padding)."""
    if data.dtype != torch.uint8 or data.numel() != (count + 4) // 5:
        raise ValueError(f"base-3 ternary: need {(count + 4) // 5} uint8 bytes for {count} codes.")
    values = data.reshape(-1).to(torch.int64)
    if bool((values > 242).any()):
        raise ValueError("base-3 ternary: byte above 242 (3**5 - 1).")
    digits = ((values[:, None] // _POW3.to(values.device)) % 3).reshape(-1)
    if bool((digits[count:] != 1).any()):
        raise ValueError("base-3 ternary: padding trits must be 0.")
    return (digits[:count] - 1).to(torch.int8)


def pack_binary(codes: torch.Tensor) -> torch.Tensor:
    """Pack binary codes in ``{-1, +1}`` one bit each (set = -1)."""
    return _pack_fields((_flat_codes(codes, (-1, 1)) < 0).to(torch.int64), 8)


def unpack_binary(data: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_binary`."""
    return (1 - 2 * _unpack_fields(data, count, 8, "1-bit binary")).to(torch.int8)


# --------------------------------------------------------------------------------------------- popcount matmul
def _pack_rows(bits: torch.Tensor, word_bits: int) -> torch.Tensor:
    if word_bits not in (8, 64):
        raise ValueError(f"word_bits must be 8 or 64, got {word_bits}.")
    *lead, k = bits.shape
    pad = (-k) % word_bits
    if pad:
        bits = torch.cat((bits, bits.new_zeros(*lead, pad)), dim=-1)
    octets = bits.reshape(*lead, -1, 8).to(torch.int64) << torch.arange(8)
    packed = octets.sum(dim=-1).to(torch.uint8).contiguous()
    return packed if word_bits == 8 else packed.view(torch.int64)


def pack_signs(x: torch.Tensor, word_bits: int = 64) -> torch.Tensor:
    """Sign bits (set where ``x < 0``) of the last dim of ``x`` packed into ``uint8`` (8) or ``int64`` (64) words."""
    return _pack_rows(x.detach().cpu() < 0, word_bits)


def pack_mask(x: torch.Tensor, word_bits: int = 64) -> torch.Tensor:
    """Non-zero bits (set where ``x != 0``) of the last dim of ``x`` packed into words."""
    return _pack_rows(x.detach().cpu() != 0, word_bits)


def popcount(words: torch.Tensor) -> torch.Tensor:
    """Set bits per element of an integer tensor (uint8 / int64), as int64 of the same shape."""
    raw = words.contiguous().view(torch.uint8).to(torch.int64)
    counts = _POPCOUNT_LUT.to(raw.device)[raw]
    return counts.view(*words.shape, words.element_size()).sum(dim=-1)


def _chunked(a_words: torch.Tensor, n_rows: int, row_fn: Any) -> torch.Tensor:
    per_row = max(1, n_rows * a_words.shape[-1] * a_words.element_size() * 8)
    step = max(1, _CHUNK_BYTES // per_row)
    return torch.cat([row_fn(a_words[i : i + step]) for i in range(0, a_words.shape[0], step)], dim=0)


def binary_matmul(a_words: torch.Tensor, w_words: torch.Tensor, k: int) -> torch.Tensor:
    """``a @ w.T`` for ``+/-1`` matrices given as packed sign words ``(M, W)`` and ``(N, W)`` of ``K = k`` columns."""
    if a_words.shape[-1] != w_words.shape[-1] or a_words.dtype != w_words.dtype:
        raise ValueError("a_words and w_words must have the same word count and dtype.")
    return _chunked(a_words, w_words.shape[0], lambda a: k - 2 * popcount(a[:, None, :] ^ w_words[None]).sum(-1))


def ternary_matmul(a_words: torch.Tensor, w_sign_words: torch.Tensor, w_mask_words: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` for ``+/-1`` activations and ternary weights (sign words + non-zero mask words)."""
    if not (a_words.shape[-1] == w_sign_words.shape[-1] == w_mask_words.shape[-1]):
        raise ValueError("a_words, w_sign_words and w_mask_words must have the same word count.")
    nonzero = popcount(w_mask_words).sum(-1)

    def rows(a: torch.Tensor) -> torch.Tensor:
        disagree = popcount((a[:, None, :] ^ w_sign_words[None]) & w_mask_words[None]).sum(-1)
        return nonzero[None] - 2 * disagree

    return _chunked(a_words, w_sign_words.shape[0], rows)


def packed_matmul(a: torch.Tensor, w: torch.Tensor, word_bits: int = 64) -> torch.Tensor:
    """Exact ``a @ w.T`` (int64) via XOR + popcount for ``a`` in ``{-1, +1}^(M, K)`` and ``w`` binary or ternary.

    Raises:
        ValueError: ``a`` is not +/-1, ``w`` holds values outside ``{-1, 0, 1}``, or the shapes disagree.
    """
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"need a (M, K) and w (N, K), got {tuple(a.shape)} and {tuple(w.shape)}.")
    _flat_codes(a, (-1, 1))
    _flat_codes(w, (-1, 0, 1))
    a_words = pack_signs(a, word_bits)
    if bool((w == 0).any()):
        return ternary_matmul(a_words, pack_signs(w, word_bits), pack_mask(w, word_bits))
    return binary_matmul(a_words, pack_signs(w, word_bits), a.shape[1])


# --------------------------------------------------------------------------------------------- checkpoints
def save_packed(module: nn.Module, path: str | os.PathLike[str], ternary_format: str = "2bit") -> dict[str, int]:
    """Save ``module.state_dict()`` with every low-bit weight packed (safetensors, no pickle).

    Each low-bit layer ``name`` is stored as ``name.codes.packed`` (uint8) plus ``name.scale`` (fp32) instead of its
    ``name.codes`` buffer (flip mode) or latent ``name.weight`` (ste mode, quantized first); everything else is saved
    unchanged. The file metadata records each packed tensor's kind, shape and format.

    Returns:
        ``{"packed_bytes": ..., "other_bytes": ...}`` tensor bytes written.
    """
    from safetensors.torch import save_file

    if ternary_format not in PACKED_FORMATS:
        raise ValueError(f"ternary_format must be one of {list(PACKED_FORMATS)}, got {ternary_format!r}.")
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in module.state_dict().items()}
    metadata: dict[str, str] = {}
    packed_bytes = 0
    for name, layer in lowbit_layers(module):
        codes, scale = layer.quantized()
        prefix = f"{name}." if name else ""
        tensors.pop(f"{prefix}weight", None)
        tensors.pop(f"{prefix}codes", None)
        if layer.kind == "binary":
            fmt, packed = "1bit", pack_binary(codes)
        elif ternary_format == "2bit":
            fmt, packed = "2bit", pack_ternary_2bit(codes)
        else:
            fmt, packed = "base3", pack_ternary_base3(codes)
        tensors[f"{prefix}codes.packed"] = packed
        tensors[f"{prefix}scale"] = scale.detach().float().cpu().contiguous().clone()
        metadata[f"{prefix}codes.packed"] = json.dumps({"kind": layer.kind, "shape": list(codes.shape), "format": fmt})
        packed_bytes += packed.numel()
    other = sum(t.numel() * t.element_size() for k, t in tensors.items() if k not in metadata)
    save_file(tensors, os.fspath(path), metadata=metadata)
    return {"packed_bytes": packed_bytes, "other_bytes": other}


_FORMATS_OF_KIND = {"binary": ("1bit",), "ternary": ("2bit", "base3")}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})[:4]}")
    return dict(pairs)


def _packed_header(key: str, text: str | None) -> tuple[list[int], str]:
    """The ``(shape, format)`` of packed tensor ``key`` from its metadata; ValueError naming ``key`` and the field."""
    if text is None:
        raise ValueError(f"{key}: missing packing metadata (no header for this packed tensor).")
    try:
        info = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as error:  # RecursionError: a nesting bomb in the header
        raise ValueError(f"{key}: invalid packing metadata ({str(error)[:120]}).") from None
    if not isinstance(info, dict):
        raise ValueError(f"{key}: invalid packing metadata (a {type(info).__name__}, expected an object).")
    kind, shape, fmt = info.get("kind"), info.get("shape"), info.get("format")
    if not isinstance(kind, str) or kind not in _FORMATS_OF_KIND:
        raise ValueError(f"{key}: packing metadata kind={kind!r:.40}; expected 'binary' or 'ternary'.")
    if not isinstance(fmt, str) or fmt not in _FORMATS_OF_KIND[kind]:
        raise ValueError(
            f"{key}: packing metadata format={fmt!r:.40} for kind {kind!r}; expected one of "
            f"{list(_FORMATS_OF_KIND[kind])}."
        )
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise ValueError(f"{key}: packing metadata shape={shape!r:.80}; expected a list of integers.")
    if any(size < 0 for size in shape):
        raise ValueError(f"{key}: packing metadata shape={shape!r:.80} has a negative size.")
    if math.prod(max(size, 1) for size in shape) >= 2**63:  # an empty tensor of such a shape has no int64 strides
        raise ValueError(f"{key}: packing metadata shape={shape!r:.80} is too large for a tensor.")
    return shape, fmt


def load_packed(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Load a :func:`save_packed` file as a state dict for flip-mode layers (``name.codes`` int8 + ``name.scale``).

    The file is never trusted: each packed tensor's header (``kind``, ``shape``, ``format``) must be well-formed
    and consistent, its bytes must decode to exactly ``prod(shape)`` codes, and its ``name.scale`` must be a finite
    floating-point tensor.

    Raises:
        ValueError: Not a safetensors file; a packed tensor without valid metadata (the message names the tensor and
            the field: negative, non-integer or huge shape, unknown kind or format, duplicate keys, NaN); packed
            bytes that do not decode exactly; a missing or non-finite scale; or a ``name.codes`` stored next to its
            packed form.
    """
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(os.fspath(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(os.fspath(path))
    except SafetensorError as error:  # a truncated or foreign file: say which, as a ValueError like the rest
        raise ValueError(f"{os.fspath(path)} is not a readable safetensors file ({error}).") from None
    out: dict[str, torch.Tensor] = {}
    unpackers = {"1bit": unpack_binary, "2bit": unpack_ternary_2bit, "base3": unpack_ternary_base3}
    for key, tensor in tensors.items():
        if not key.endswith("codes.packed"):
            out[key] = tensor
            continue
        shape, fmt = _packed_header(key, metadata.get(key))
        codes_key, scale_key = key.removesuffix(".packed"), key.removesuffix("codes.packed") + "scale"
        if codes_key in tensors:
            raise ValueError(f"{key}: the file also holds {codes_key}; which one is meant is ambiguous.")
        scale = tensors.get(scale_key)
        if scale is None or not scale.is_floating_point() or not bool(torch.isfinite(scale).all()):
            raise ValueError(f"{key}: its scale {scale_key} is missing, not floating point or not finite.")
        count = math.prod(shape)
        if count > 8 * tensor.numel():  # bound what the header announces by what the bytes can hold, before unpacking
            raise ValueError(
                f"{key}: packing metadata shape={shape!r:.80} announces {count} codes; its {tensor.numel()} packed "
                "bytes hold at most 8 per byte."
            )
        try:
            codes = unpackers[fmt](tensor, count)
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from None
        out[codes_key] = codes.reshape(shape)
    return out
