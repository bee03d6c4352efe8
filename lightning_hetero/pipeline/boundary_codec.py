"""The boundary codec: how the per-token coordinates travel between stages, in both directions.

- ``fp32`` / ``bf16``: the stage output is the coordinate tensor cast to that dtype. Autograd's cast makes the
  backward message (the gradient of the received tensor) the same shape and dtype, so a ``bf16`` boundary sends
  ``B*S*k*2`` bytes each way. ``fp32`` is lossless (exact reconstruction); ``bf16`` rounds to 8 mantissa bits.
- ``int8`` (lossy, both directions): per token, a symmetric scale ``s = max|c| / 127`` and ``q = round(c / s)``.
  Pipeline runtimes need a floating tensor that can carry a gradient, so the payload is packed into a float32
  *container* of shape ``(B, S, ceil(k/4) + 1)``: the int8 bytes (padded to a multiple of 4) bit-cast to float32,
  plus the scale. The backward message (``dL/dc``) is quantised and packed the same way by the receiver's decode
  and unpacked by the sender's encode (:class:`torch.autograd.Function` pairs). Bytes per token: ``4*ceil(k/4) + 4``.
  The container's bits are only moved, never used in float arithmetic (some are NaN patterns).

The same codec carries the ``d``-wide activations when ``compress=False`` (``int8`` then is the "int8 activations"
lossy baseline).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError, check_values, peer_decoding

__all__ = ["BoundaryCodec", "pack_int8", "unpack_int8", "value_bound"]

_WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}
_INT8_MAX = 127
"""Largest |byte| the int8 codec emits: -128 is never encoded, so a received -128 is refused."""


def value_bound(dtype: torch.dtype | None = None) -> float:
    """Largest magnitude a decoded peer value may have: ``MAX_PEER_MAGNITUDE``, or less if ``dtype`` overflows first.

    The bound is representable in ``dtype`` and rounding to nearest is monotonic, so a value within it stays within
    it (and finite) when cast to ``dtype``.
    """
    if dtype is None or not dtype.is_floating_point:
        return MAX_PEER_MAGNITUDE
    return min(MAX_PEER_MAGNITUDE, float(torch.finfo(dtype).max))


def pack_int8(values: Tensor) -> Tensor:
    """Quantise ``(..., k)`` to int8 with one scale per row and pack into a float32 ``(..., ceil(k/4) + 1)``."""
    values = values.to(torch.float32)
    width = values.shape[-1]
    padded = 4 * math.ceil(width / 4)
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    quantised = torch.round(values / scale).clamp_(-127, 127).to(torch.int8)
    if padded != width:
        quantised = torch.nn.functional.pad(quantised, (0, padded - width))
    payload = quantised.contiguous().view(torch.float32)  # bit-cast: 4 int8 per float32 slot
    return torch.cat([payload, scale], dim=-1)


def unpack_int8(container: Tensor, width: int) -> Tensor:
    """Inverse of :func:`pack_int8`: float32 ``(..., k)``."""
    payload = container[..., :-1].contiguous().view(torch.int8)[..., :width]
    return payload.to(torch.float32) * container[..., -1:]


class _Int8Encode(torch.autograd.Function):
    """Forward: pack coordinates. Backward: unpack the (int8-packed) gradient message."""

    @staticmethod
    def forward(ctx: Any, values: Tensor) -> Tensor:
        ctx.width, ctx.dtype = values.shape[-1], values.dtype
        return pack_int8(values)

    @staticmethod
    def backward(ctx: Any, grad_container: Tensor) -> Tensor:
        return unpack_int8(grad_container, ctx.width).to(ctx.dtype)


class _Int8Decode(torch.autograd.Function):
    """Forward: unpack the received container. Backward: quantise and pack ``dL/dc`` for the way back."""

    @staticmethod
    def forward(ctx: Any, container: Tensor, width: int, dtype: torch.dtype) -> Tensor:
        return unpack_int8(container, width).to(dtype)

    @staticmethod
    def backward(ctx: Any, grad_values: Tensor) -> tuple[Tensor, None, None]:
        return pack_int8(grad_values), None, None


class BoundaryCodec:
    """Encoder/decoder of the tensor crossing a stage boundary (``width`` = k, or d when uncompressed).

    Args:
        coord_dtype: ``"fp32"``, ``"bf16"`` or ``"int8"``.
        width: Numbers per token before encoding.
    """

    def __init__(self, coord_dtype: str, width: int) -> None:
        if coord_dtype not in _WIRE_DTYPES:
            raise ValueError(f"coord_dtype={coord_dtype!r}; use one of {', '.join(_WIRE_DTYPES)}.")
        self.coord_dtype = coord_dtype
        self.width = int(width)

    @property
    def wire_dtype(self) -> torch.dtype:
        """dtype of the tensor on the wire (float32 container for int8)."""
        return _WIRE_DTYPES[self.coord_dtype]

    @property
    def wire_width(self) -> int:
        """Last dimension of the wire tensor."""
        return math.ceil(self.width / 4) + 1 if self.coord_dtype == "int8" else self.width

    def wire_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """Shape of the wire tensor for a ``(batch, seq)`` token block."""
        return (batch, seq, self.wire_width)

    def wire_bytes(self, batch: int, seq: int) -> int:
        """Bytes per direction for a ``(batch, seq)`` block: ``B*S*k*bytes`` (int8: ``B*S*(4*ceil(k/4) + 4)``)."""
        return batch * seq * self.wire_width * torch.empty((), dtype=self.wire_dtype).element_size()

    def encode(self, values: Tensor) -> Tensor:
        """Differentiable: ``(..., width)`` -> wire tensor."""
        if self.coord_dtype == "int8":
            return _Int8Encode.apply(values)
        return values.to(self.wire_dtype)

    def decode(self, wire: Tensor, dtype: torch.dtype) -> Tensor:
        """Differentiable: wire tensor -> ``(..., width)`` in ``dtype``."""
        if wire.shape[-1] != self.wire_width:
            raise ValueError(
                f"boundary tensor has last dimension {wire.shape[-1]} but this stage expects {self.wire_width} "
                f"({self.coord_dtype} codec of width {self.width}); are both stages built with the same config?"
            )
        if self.coord_dtype == "int8":
            return _Int8Decode.apply(wire, self.width, dtype)
        return wire.to(dtype)

    def check_wire(
        self,
        wire: Tensor,
        *,
        peer: int | None = None,
        what: str = "boundary tensor",
        dtype: torch.dtype | None = None,
    ) -> None:
        """Refuse a received wire tensor unless it decodes to finite values within the peer-payload bound.

        ``fp32``/``bf16``: every number must be finite and of magnitude at most :func:`value_bound` (``dtype``).
        ``int8``: the payload slots are raw int8 bytes (NaN bit patterns are legitimate there): every byte must be in
        ``[-127, 127]`` (the encoder never emits -128), the padding bytes zero, and the per-token scale (the last
        slot) finite, >= 0 and at most ``value_bound(dtype) / 127``, so ``byte * scale`` stays within the bound.

        Args:
            wire: The received tensor.
            peer: The sending rank (named in the error).
            what: What the tensor is (named in the error).
            dtype: The dtype the receiver decodes to (None: only :data:`MAX_PEER_MAGNITUDE`); a float16 stage
                refuses values a float16 cannot hold.

        Raises:
            PeerPayloadError: Wrong last dimension or dtype (field ``"shape"``), NaN/Inf or oversized values
                (``"values"``), a -128 byte or non-zero padding (``"payload"``), or a bad scale (``"scale"``).
        """
        if wire.shape[-1:] != (self.wire_width,) or wire.dtype != self.wire_dtype:
            raise PeerPayloadError(
                f"{what} from rank {peer} has shape {tuple(wire.shape)} and dtype {wire.dtype}; the {self} expects"
                f" last dimension {self.wire_width} and {self.wire_dtype}.",
                peer,
                "shape",
            )
        bound = value_bound(dtype)
        into = "" if dtype is None else f" (this stage decodes to {dtype}, bound {bound:.3g})"
        if self.coord_dtype != "int8":
            try:
                check_values(wire, peer=peer, what=what, bound=bound)
            except PeerPayloadError as error:
                raise PeerPayloadError(f"{error}{into}", peer, "values") from None
            return
        self._check_int8(wire, peer, what, bound, into)

    def _check_int8(self, wire: Tensor, peer: int | None, what: str, bound: float, into: str) -> None:
        payload = wire[..., :-1].contiguous().view(torch.int8)
        if payload.numel() and bool((payload[..., : self.width] == -128).any()):
            raise PeerPayloadError(
                f"{what} from rank {peer} holds an int8 byte of -128, which the codec never encodes (|byte| <= 127);"
                " refusing to decode it.",
                peer,
                "payload",
            )
        if payload.numel() and bool((payload[..., self.width :] != 0).any()):
            raise PeerPayloadError(
                f"{what} from rank {peer} holds non-zero int8 padding bytes; refusing to decode it.", peer, "payload"
            )
        scale = wire[..., -1]
        # In float64, 127 * scale is exact: compare the largest decodable value itself with the bound.
        if scale.numel() and not bool(((scale >= 0) & (scale.double() * _INT8_MAX <= bound)).all()):
            raise PeerPayloadError(
                f"{what} from rank {peer} holds a negative, non-finite or overflowing int8 scale (127 x scale must "
                f"be at most {bound:.3g}){into}; refusing to decode it.",
                peer,
                "scale",
            )

    def decode_received(
        self, wire: Tensor, dtype: torch.dtype, *, peer: int | None = None, what: str = "boundary tensor"
    ) -> Tensor:
        """:meth:`check_wire` then :meth:`decode`: finite values within :func:`value_bound` (``dtype``), or a refusal.

        Raises:
            PeerPayloadError: Anything :meth:`check_wire` refuses; nothing else escapes.
        """
        with peer_decoding(peer, what):
            self.check_wire(wire, peer=peer, what=what, dtype=dtype)
            return self.decode(wire, dtype)

    def __repr__(self) -> str:
        return f"BoundaryCodec({self.coord_dtype!r}, width={self.width})"
