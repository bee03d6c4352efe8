"""Ternary / binary ``Linear`` and ``Conv2d`` layers in two modes (swapped into models by ``sparseflip.convert``).

Modes:

- ``"ste"``: a latent fp master ``weight`` (an ``nn.Parameter``) is quantized in every forward pass
  (:func:`~lightning_hetero.sparseflip.quant.quantize_ste`); any torch optimizer trains it. The strong baseline.
- ``"flip"``: the weight exists only as int8 ``codes`` (a buffer in ``{-1, 0, 1}`` or ``{-1, 1}``) and an fp32
  ``scale`` buffer (0-d, or ``(out, 1, ...)`` per row). The forward pass computes with ``scale * codes``; the backward
  pass stores ``dL/dcodes = scale * dL/dW`` (float32, accumulated over forward calls) in ``layer.code_grad``, the
  first-order loss change of moving each code by one step, where the flip optimizers of
  :mod:`lightning_hetero.sparseflip.flip` find it. There is no fp master copy. Biases stay ordinary fp parameters.
  With ``trainable_scale=True`` the scale is an ``nn.Parameter`` instead of a buffer (one number per layer or per
  output row): it receives ``dL/dscale = sum(codes * dL/dW)`` and is trained by the user's fp optimizer together
  with the biases, so magnitudes adapt while the codes flip.

Layouts: the weight is stored output channel first (``(out, in)`` / ``(out, in/groups, kh, kw)``) whatever the source;
HF GPT-2 ``Conv1D`` (weight ``(in, out)``, ``y = x @ W + b``) is converted to a :class:`LowBitLinear` holding the
transposed weight, so "row" always means output channel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import Self

from lightning_hetero.sparseflip.quant import (
    dequantize,
    quantize,
    quantize_ste,
    validate_granularity,
    validate_kind,
)

__all__ = [
    "MODES",
    "BinaryConv2d",
    "BinaryLinear",
    "LowBitConv2d",
    "LowBitLinear",
    "TernaryConv2d",
    "TernaryLinear",
    "lowbit_layers",
    "validate_mode",
]

MODES: tuple[str, ...] = ("ste", "flip")
"""Latent fp weights quantized in forward, or weights held only as int8 codes."""


def validate_mode(mode: object) -> str:
    """Return ``mode`` if it is ``"ste"`` or ``"flip"``, else raise a ValueError naming the valid values."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}.")
    return str(mode)


class _LowBitWeight(nn.Module):
    """Shared weight handling of the low-bit layers (not used directly)."""

    code_grad: torch.Tensor | None

    def _init_weight(
        self,
        shape: tuple[int, ...],
        bias: bool,
        kind: str,
        mode: str,
        granularity: str,
        device: Any = None,
        dtype: torch.dtype | None = None,
        trainable_scale: bool = False,
    ) -> None:
        self.kind = validate_kind(kind)
        self.mode = validate_mode(mode)
        self.granularity = validate_granularity(granularity)
        self.weight_shape = tuple(shape)
        self.code_grad = None
        self.trainable_scale = bool(trainable_scale)
        if trainable_scale and mode != "flip":
            raise ValueError("trainable_scale=True needs mode='flip' (an ste layer derives its scale from the weight).")
        if mode == "ste":
            self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        else:
            scale_shape = () if granularity == "layer" else (shape[0],) + (1,) * (len(shape) - 1)
            self.register_buffer("codes", torch.zeros(shape, dtype=torch.int8, device=device))
            scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
            if trainable_scale:
                self.scale = nn.Parameter(scale)
            else:
                self.register_buffer("scale", scale)
        self.bias = nn.Parameter(torch.zeros(shape[0], device=device, dtype=dtype)) if bias else None
        dense = torch.empty(shape, device=device)
        nn.init.kaiming_uniform_(dense, a=5**0.5)  # nn.Linear's and nn.Conv2d's default
        self.load_dense_(dense)

    def _load_dense_and_bias_(
        self, weight: torch.Tensor, bias: torch.Tensor | None, zero_fraction: float | None
    ) -> Self:
        """:meth:`load_dense_` ``weight``, copy ``bias`` (if any) and return the layer (the ``from_*`` builders)."""
        self.load_dense_(weight.detach(), zero_fraction)
        if bias is not None:
            with torch.no_grad():
                self.bias.copy_(bias)
        return self

    def load_dense_(self, weight: torch.Tensor, zero_fraction: float | None = None) -> None:
        """Set the weight from a dense fp tensor (output channel first): copied (ste) or quantized (flip).

        Args:
            weight: Dense weight, output channel first.
            zero_fraction: Flip mode, ternary: share of zero codes per scale group (see
                :func:`~lightning_hetero.sparseflip.quant.ternary_quantize`); None: absmean rounding.
        """
        if tuple(weight.shape) != self.weight_shape:
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match {self.weight_shape}.")
        with torch.no_grad():
            if self.mode == "ste":
                self.weight.copy_(weight)
            else:
                codes, scale = quantize(weight.float(), self.kind, self.granularity, zero_fraction=zero_fraction)
                self.codes.copy_(codes)
                self.scale.copy_(scale)

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes int8, scale fp32)`` of the weight the layer computes with (quantizes the latent one in ste)."""
        if self.mode == "flip":
            return self.codes, self.scale.detach()
        codes, scale = quantize(self.weight.float(), self.kind, self.granularity)
        return codes, scale.float()

    def effective_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight used in forward; in flip mode its gradient is routed to :attr:`code_grad`."""
        if self.mode == "ste":
            weight = quantize_ste(self.weight, self.kind, self.granularity)
            return weight if dtype is None else weight.to(dtype)
        weight = dequantize(self.codes, self.scale, dtype or torch.float32)
        if torch.is_grad_enabled():
            weight.requires_grad_(True)
            weight.register_hook(self._store_code_grad)
        return weight

    def _store_code_grad(self, grad: torch.Tensor) -> None:
        code_grad = grad.float() * self.scale.detach()
        self.code_grad = code_grad if self.code_grad is None else self.code_grad + code_grad

    def zero_code_grad(self) -> None:
        """Forget the accumulated :attr:`code_grad` (flip mode)."""
        self.code_grad = None

    def extra_repr(self) -> str:
        trainable = ", trainable_scale=True" if self.trainable_scale else ""
        return f"kind={self.kind}, mode={self.mode}, granularity={self.granularity}{trainable}"


class LowBitLinear(_LowBitWeight):
    """``y = x @ (scale * codes).T + b`` with ternary or binary codes (see the module docstring for the modes).

    Args:
        in_features: Input width.
        out_features: Output width.
        bias: Add a learnable fp bias.
        kind: ``"ternary"`` or ``"binary"``.
        mode: ``"ste"`` or ``"flip"``.
        granularity: ``"layer"`` or ``"row"`` scales.
        device: Device of the new tensors.
        dtype: dtype of the latent weight and bias (the flip scale is always fp32).
        trainable_scale: Flip mode only: hold the scale as an ``nn.Parameter`` trained by the fp optimizer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        kind: str = "ternary",
        mode: str = "ste",
        granularity: str = "layer",
        device: Any = None,
        dtype: torch.dtype | None = None,
        trainable_scale: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_weight((out_features, in_features), bias, kind, mode, granularity, device, dtype, trainable_scale)

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kind: str,
        mode: str,
        granularity: str,
        trainable_scale: bool = False,
        zero_fraction: float | None = None,
    ) -> LowBitLinear:
        """A layer initialised from a dense ``(out, in)`` weight and optional bias (see :meth:`load_dense_`)."""
        layer = cls.__new__(cls)
        LowBitLinear.__init__(
            layer,
            weight.shape[1],
            weight.shape[0],
            bias is not None,
            kind,
            mode,
            granularity,
            weight.device,
            weight.dtype,
            trainable_scale,
        )
        return layer._load_dense_and_bias_(weight, bias, zero_fraction)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer."""
        return F.linear(x, self.effective_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {super().extra_repr()}"


class LowBitConv2d(_LowBitWeight):
    """2-D convolution with ternary or binary codes (``padding_mode="zeros"`` only).

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        kernel_size: Kernel size (int or pair).
        stride: Stride.
        padding: Padding (int, pair, ``"same"`` or ``"valid"``).
        dilation: Dilation.
        groups: Groups.
        bias: Add a learnable fp bias.
        kind: ``"ternary"`` or ``"binary"``.
        mode: ``"ste"`` or ``"flip"``.
        granularity: ``"layer"`` or ``"row"`` (per output channel) scales.
        device: Device of the new tensors.
        dtype: dtype of the latent weight and bias.
        trainable_scale: Flip mode only: hold the scale as an ``nn.Parameter`` trained by the fp optimizer.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        kind: str = "ternary",
        mode: str = "ste",
        granularity: str = "layer",
        device: Any = None,
        dtype: torch.dtype | None = None,
        trainable_scale: bool = False,
    ) -> None:
        super().__init__()
        pair = nn.modules.utils._pair
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride, self.dilation = pair(kernel_size), pair(stride), pair(dilation)
        self.padding = padding if isinstance(padding, str) else pair(padding)
        shape = (out_channels, in_channels // groups, *self.kernel_size)
        self._init_weight(shape, bias, kind, mode, granularity, device, dtype, trainable_scale)

    @classmethod
    def from_conv2d(
        cls,
        conv: nn.Conv2d,
        kind: str,
        mode: str,
        granularity: str,
        trainable_scale: bool = False,
        zero_fraction: float | None = None,
    ) -> LowBitConv2d:
        """A layer with the geometry and (quantized) weights of ``conv`` (see :meth:`load_dense_`)."""
        if conv.padding_mode != "zeros":
            raise ValueError(f"only padding_mode='zeros' is supported, got {conv.padding_mode!r}.")
        layer = cls.__new__(cls)
        LowBitConv2d.__init__(
            layer,
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups,
            conv.bias is not None,
            kind,
            mode,
            granularity,
            conv.weight.device,
            conv.weight.dtype,
            trainable_scale,
        )
        return layer._load_dense_and_bias_(conv.weight, conv.bias, zero_fraction)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer."""
        weight = self.effective_weight(x.dtype)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, {super().extra_repr()}"
        )


def _fixed_kind(base: type, kind: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        if "kind" in kwargs:
            raise TypeError(f"{type(self).__name__} is always {kind}; do not pass kind=.")
        base.__init__(self, *args, kind=kind, **kwargs)

    name = f"{kind.capitalize()}{base.__name__.removeprefix('LowBit')}"
    doc = f"{base.__name__} with ``kind={kind!r}`` (same arguments, without ``kind``)."
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


TernaryLinear: type[LowBitLinear] = _fixed_kind(LowBitLinear, "ternary")
BinaryLinear: type[LowBitLinear] = _fixed_kind(LowBitLinear, "binary")
TernaryConv2d: type[LowBitConv2d] = _fixed_kind(LowBitConv2d, "ternary")
BinaryConv2d: type[LowBitConv2d] = _fixed_kind(LowBitConv2d, "binary")


def lowbit_layers(module: nn.Module, mode: str | None = None) -> list[tuple[str, _LowBitWeight]]:
    """``(name, layer)`` of every low-bit layer in ``module`` (optionally only one mode), in module order."""
    return [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, _LowBitWeight) and (mode is None or m.mode == mode)
    ]
