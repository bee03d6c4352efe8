"""Moving dtypes gloo lacks: bit-cast for data movement, upcast for reductions.

gloo rejects int16, uint16, uint32, uint64, the float8 family and other exotic dtypes with
``RuntimeError: Invalid scalar type`` (shared/research/offline-and-cpu.md, B4). The counted collectives route every
tensor through these helpers:

- data movement (all_gather, broadcast, all_to_all, send/recv) sends the raw bytes: a flat ``uint8`` view, exact and
  the same size;
- reductions need arithmetic, so they run in a wider dtype: int16/uint16 -> int32, uint32 -> int64, float8 ->
  float32; uint64 is reinterpreted as int64 (sum, product and bitwise ops produce the same bits in two's complement;
  for min/max the sign bit is flipped before and after, which maps unsigned order onto signed order). Results are
  cast back with a wrapping integer cast (the exact wide result modulo 2**bits, i.e. what a native wrapping reduction
  would give) or torch's float8 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["FLOAT8_DTYPES", "GLOO_NATIVE_DTYPES", "as_wire_input", "as_wire_output", "reduction_wire"]

#: Dtypes gloo handles natively (measured in torch 2.13); anything else is bit-cast or upcast.
GLOO_NATIVE_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)
#: Float8 variants of this torch build; all reduce in float32.
FLOAT8_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)
_INT_UPCAST = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
_INT64_SIGN_BIT = torch.iinfo(torch.int64).min


def as_wire_input(tensor: torch.Tensor) -> torch.Tensor:
    """A read-only input as gloo can send it: ``tensor`` itself, or its bytes as a flat uint8 tensor."""
    if tensor.dtype in GLOO_NATIVE_DTYPES:
        return tensor
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def as_wire_output(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """A writable buffer as gloo can fill it: ``tensor`` itself, or a flat uint8 view sharing its memory.

    Raises:
        ValueError: The dtype needs bit-casting but ``tensor`` is not contiguous (a view could not alias it).
    """
    if tensor.dtype in GLOO_NATIVE_DTYPES:
        return tensor
    if not tensor.is_contiguous():
        raise ValueError(f"{what} of dtype {tensor.dtype} must be contiguous to be bit-cast to uint8 for transport.")
    return tensor.reshape(-1).view(torch.uint8)


def reduction_wire(tensor: torch.Tensor, op: str) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
    """What to reduce on the wire for ``tensor``, and how to store a reduced wire tensor back into ``tensor``.

    Args:
        tensor: The caller's tensor.
        op: Reduce op name (``"sum"``, ``"avg"``, ``"min"``, ...).

    Returns:
        ``(wire, write_back)``: ``wire`` is ``tensor`` itself for native dtypes (write_back does nothing), else a new
        tensor in the wider dtype; ``write_back(result)`` casts ``result`` back into ``tensor`` in place.

    Raises:
        ValueError: ``op="avg"`` on a non-floating dtype.
        TypeError: A dtype with neither native support nor an exact upcast (bits, float4, complex32).
    """
    dtype = tensor.dtype
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"op='avg' needs a floating-point tensor, got {dtype}; reduce with 'sum' and divide yourself.")
    if dtype in GLOO_NATIVE_DTYPES:
        return tensor, lambda wire: None
    if dtype in _INT_UPCAST:
        return tensor.to(_INT_UPCAST[dtype]), lambda wire: tensor.copy_(wire.to(dtype))
    if dtype == torch.uint64:
        flip = op in ("min", "max")
        wire = tensor.view(torch.int64).clone()
        if flip:
            wire ^= _INT64_SIGN_BIT

        def write_back_uint64(result: torch.Tensor) -> None:
            tensor.view(torch.int64).copy_(result ^ _INT64_SIGN_BIT if flip else result)

        return wire, write_back_uint64
    if dtype in FLOAT8_DTYPES:
        return tensor.to(torch.float32), lambda wire: tensor.copy_(wire.to(dtype))
    raise TypeError(
        f"Reductions of dtype {dtype} are not supported (gloo lacks it and there is no exact upcast); cast the"
        " tensor to a supported dtype first, or all_gather it and reduce locally."
    )
