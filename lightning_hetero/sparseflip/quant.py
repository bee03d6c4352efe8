"""Ternary and binary weight quantizers with a per-layer or per-row fp scale, and straight-through estimators.

Quantizers (``W`` is a weight tensor whose dim 0 is the output channel, the torch ``Linear``/``Conv2d`` layout):

- **ternary** (BitNet b1.58 "absmean"): ``scale = mean|W|`` and ``codes = clamp(round(W / scale), -1, 1)``, so
  ``codes`` lie in ``{-1, 0, +1}``; the dequantized weight is ``scale * codes``.
- **binary**: ``scale = mean|W|`` and ``codes = sign(W)`` with ``sign(0) = +1`` (one bit cannot say zero), so
  ``codes`` lie in ``{-1, +1}``.

``granularity="layer"`` uses one scale for the whole tensor (a 0-d tensor); ``"row"`` one per output channel, shaped
``(out, 1, ...)`` so it broadcasts against ``W``. A scale is floored at ``eps`` so an all-zero tensor quantizes to
zeros (ternary) or ``+eps`` (binary) instead of dividing by zero.

The straight-through estimators return ``scale * codes`` in the forward pass and pass the incoming gradient to the
latent fp weight unchanged in the backward pass (BitNet's ``w + (q(w) - w).detach()``); ``clip`` zeroes it where
``|W| > clip * scale`` (the classic BinaryConnect/XNOR "hardtanh" STE). The scale gets no gradient (it is a statistic
of ``W``). :func:`sign_ste` binarizes activations with the hardtanh STE: ``d sign(x)/dx := 1[|x| <= 1]``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "GRANULARITIES",
    "KINDS",
    "binary_quantize",
    "compute_scale",
    "dequantize",
    "quantize",
    "quantize_ste",
    "sign_ste",
    "ternary_quantize",
    "validate_granularity",
    "validate_kind",
]

KINDS: tuple[str, ...] = ("ternary", "binary")
"""Supported weight alphabets: ``{-1, 0, +1}`` and ``{-1, +1}``."""
GRANULARITIES: tuple[str, ...] = ("layer", "row")
"""Scale groups: one fp scale per tensor or per output channel (dim 0)."""

_EPS = 1e-8


def validate_kind(kind: object) -> str:
    """Return ``kind`` if it is ``"ternary"`` or ``"binary"``, else raise a ValueError naming the valid values."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}.")
    return str(kind)


def validate_granularity(granularity: object) -> str:
    """Return ``granularity`` if it is ``"layer"`` or ``"row"``, else raise a ValueError naming the valid values."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}.")
    return str(granularity)


def compute_scale(weight: torch.Tensor, granularity: str = "layer", eps: float = _EPS) -> torch.Tensor:
    """``mean|W|`` over the whole tensor (0-d result) or per output channel (shape ``(out, 1, ...)``), >= ``eps``.

    Args:
        weight: Weight tensor, output channel first.
        granularity: ``"layer"`` or ``"row"``.
        eps: Floor of the scale.

    Returns:
        The scale in the dtype of ``weight``.
    """
    granularity = validate_granularity(granularity)
    magnitude = weight.detach().abs()
    if granularity == "layer" or weight.dim() < 2:
        return magnitude.mean().clamp(min=eps)
    dims = tuple(range(1, weight.dim()))
    return magnitude.mean(dim=dims, keepdim=True).clamp(min=eps)


def ternary_quantize(
    weight: torch.Tensor, granularity: str = "layer", eps: float = _EPS, zero_fraction: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmean ternary quantization: ``(codes int8 in {-1, 0, 1}, scale)`` with ``codes = clamp(round(W/s), -1, 1)``.

    With ``zero_fraction`` the codes are instead ``sign(W)`` where ``|W|`` exceeds the ``zero_fraction`` quantile of
    ``|W|`` in its group (layer or row) and 0 elsewhere, and the scale is the mean ``|W|`` of the kept entries (the
    least-squares scale for those codes, as in ternary weight networks). Used to initialise flip-mode codes from a
    standard init with a chosen share of zeros (absmean rounding of a uniform init gives about 25%).

    Args:
        weight: Weight tensor, output channel first.
        granularity: ``"layer"`` or ``"row"``.
        eps: Floor of the scale.
        zero_fraction: Share of zeros per group, in [0, 1); None: absmean rounding.

    Returns:
        ``codes`` (int8, the shape of ``weight``) and ``scale`` (see :func:`compute_scale`).
    """
    if zero_fraction is None:
        scale = compute_scale(weight, granularity, eps)
        codes = torch.round(weight.detach() / scale).clamp_(-1, 1).to(torch.int8)
        return codes, scale
    if not 0 <= zero_fraction < 1:
        raise ValueError(f"zero_fraction must be in [0, 1) or None, got {zero_fraction!r}.")
    granularity = validate_granularity(granularity)
    magnitude = weight.detach().abs().float()
    per_row = granularity == "row" and weight.dim() >= 2
    groups = magnitude.reshape(magnitude.shape[0], -1) if per_row else magnitude.reshape(1, -1)
    cut = torch.quantile(groups, zero_fraction, dim=1, keepdim=True) if zero_fraction > 0 else None
    keep = groups > cut if cut is not None else torch.ones_like(groups, dtype=torch.bool)
    kept = (groups * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1)
    scale = kept.clamp(min=eps).to(weight.dtype)
    scale = scale.reshape(-1, *([1] * (weight.dim() - 1))) if per_row else scale.reshape(())
    codes = torch.where(keep.reshape(weight.shape), torch.where(weight.detach() < 0, -1, 1), 0).to(torch.int8)
    return codes, scale


def binary_quantize(
    weight: torch.Tensor, granularity: str = "layer", eps: float = _EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign quantization: ``(codes int8 in {-1, +1}, scale = mean|W|)``, with ``sign(0) = +1``.

    Args:
        weight: Weight tensor, output channel first.
        granularity: ``"layer"`` or ``"row"``.
        eps: Floor of the scale.

    Returns:
        ``codes`` (int8, the shape of ``weight``) and ``scale`` (see :func:`compute_scale`).
    """
    scale = compute_scale(weight, granularity, eps)
    codes = torch.where(weight.detach() < 0, -1, 1).to(torch.int8)
    return codes, scale


def quantize(
    weight: torch.Tensor,
    kind: str = "ternary",
    granularity: str = "layer",
    eps: float = _EPS,
    zero_fraction: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to :func:`ternary_quantize` (with ``zero_fraction``) or :func:`binary_quantize` by ``kind``."""
    if validate_kind(kind) == "ternary":
        return ternary_quantize(weight, granularity, eps, zero_fraction)
    return binary_quantize(weight, granularity, eps)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scale * codes`` in ``dtype`` (the weight a quantized layer computes with)."""
    return codes.to(dtype) * scale.to(dtype)


class _QuantizeSTE(torch.autograd.Function):
    """Forward ``scale * codes``; backward: identity to ``weight`` (zeroed where ``|W| > clip * scale``)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, kind: str, granularity: str, clip: float | None) -> torch.Tensor:
        codes, scale = quantize(weight, kind, granularity)
        if clip is not None:
            ctx.save_for_backward(weight.detach().abs() <= clip * scale)
        ctx.clip = clip
        return dequantize(codes, scale, weight.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if ctx.clip is None:
            return grad_output, None, None, None
        (inside,) = ctx.saved_tensors
        return grad_output * inside.to(grad_output.dtype), None, None, None


def quantize_ste(
    weight: torch.Tensor, kind: str = "ternary", granularity: str = "layer", clip: float | None = None
) -> torch.Tensor:
    """Quantize ``weight`` to ``scale * codes`` with a straight-through gradient to ``weight``.

    Args:
        weight: Latent fp weight (requires grad).
        kind: ``"ternary"`` or ``"binary"``.
        granularity: ``"layer"`` or ``"row"``.
        clip: If set, zero the gradient where ``|W| > clip * scale`` (hardtanh STE); None passes it everywhere.

    Returns:
        The dequantized weight, same shape and dtype as ``weight``.
    """
    validate_kind(kind)
    validate_granularity(granularity)
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 or None, got {clip!r}.")
    return _QuantizeSTE.apply(weight, kind, granularity, clip)


class _SignSTE(torch.autograd.Function):
    """Forward ``sign(x)`` with ``sign(0) = +1``; backward ``grad * 1[|x| <= 1]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x.abs() <= 1)
        return torch.where(x < 0, -1.0, 1.0).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        (inside,) = ctx.saved_tensors
        return grad_output * inside.to(grad_output.dtype)


def sign_ste(x: torch.Tensor) -> torch.Tensor:
    """Binary activation ``sign(x)`` in ``{-1, +1}`` with the hardtanh straight-through gradient ``1[|x| <= 1]``."""
    return _SignSTE.apply(x)
