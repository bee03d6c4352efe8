"""Swap ``nn.Linear``, ``nn.Conv2d`` and HF GPT-2 ``Conv1D`` layers of a model for ternary / binary ones.

HF ``Conv1D`` (``transformers.pytorch_utils.Conv1D``, weight ``(in, out)``, ``y = x @ W + b``) becomes a
:class:`~lightning_hetero.sparseflip.layers.LowBitLinear` holding the transposed ``(out, in)`` weight, so "row" scales
are per output feature and the output is unchanged up to quantization. transformers is never imported here: a model that
contains a ``Conv1D`` has already imported it, so the class is looked up only when ``sys.modules`` has it.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Iterable, Sequence

from torch import Tensor, nn

from lightning_hetero.sparseflip.layers import (
    BinaryConv2d,
    BinaryLinear,
    TernaryConv2d,
    TernaryLinear,
    validate_mode,
)
from lightning_hetero.sparseflip.quant import validate_granularity, validate_kind

__all__ = ["DEFAULT_SKIP", "SUPPORTED_TYPES", "convert_model"]

SUPPORTED_TYPES: tuple[str, ...] = ("Linear", "Conv2d", "Conv1D")
"""Layer types :func:`convert_model` replaces (``Conv1D`` is ``transformers.pytorch_utils.Conv1D``)."""
DEFAULT_SKIP: tuple[str, ...] = ("lm_head", "head", "heads", "classifier", "score", "*embed*", "wte", "wpe")
"""fnmatch patterns; a module is left alone when its full dotted name or any component of it matches one."""

_LINEAR_CLASS = {"ternary": TernaryLinear, "binary": BinaryLinear}
_CONV_CLASS = {"ternary": TernaryConv2d, "binary": BinaryConv2d}


def _type_name(entry: object) -> str:
    return entry.__name__ if isinstance(entry, type) else str(entry)


def _resolve_include(include: Iterable[type | str] | None) -> set[str]:
    if include is None:
        return set(SUPPORTED_TYPES)
    names = {_type_name(entry) for entry in include}
    unsupported = sorted(names - set(SUPPORTED_TYPES))
    if unsupported:
        raise ValueError(
            f"convert_model cannot convert layer type(s) {unsupported}; supported types are {list(SUPPORTED_TYPES)}"
            " (Conv1D is transformers.pytorch_utils.Conv1D)."
        )
    return names


def _skipped(name: str, patterns: Sequence[str]) -> bool:
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(name, p) or any(fnmatch.fnmatchcase(c, p) for c in parts) for p in patterns)


def _conv1d_type() -> type | None:
    """``transformers.pytorch_utils.Conv1D`` if transformers is already imported (a model using it imported it)."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - very old transformers
        return None
    return Conv1D


def convert_model(
    module: nn.Module,
    kind: str = "ternary",
    mode: str = "ste",
    granularity: str = "layer",
    skip: Sequence[str] = DEFAULT_SKIP,
    include: Iterable[type | str] | None = None,
    trainable_scale: bool = False,
    zero_fraction: float | None = None,
) -> nn.Module:
    """Replace ``nn.Linear``, ``nn.Conv2d`` and HF ``Conv1D`` submodules by low-bit layers, in place.

    Only exact types are replaced (a subclass such as ``MultiheadAttention``'s ``out_proj`` is left alone because
    its owner reads ``.weight`` directly). Embeddings, norms and anything else are never touched.

    Args:
        module: The model; modified in place (a bare supported layer is returned converted instead).
        kind: ``"ternary"`` or ``"binary"``.
        mode: ``"ste"`` or ``"flip"``.
        granularity: ``"layer"`` or ``"row"`` scales.
        skip: fnmatch patterns of module names to leave alone (the full dotted name or any component);
            the default skips heads, classifiers and embeddings.
        include: Layer types (classes or class names) to convert; default all of :data:`SUPPORTED_TYPES`.
        trainable_scale: Flip mode only: make each layer's fp scale an ``nn.Parameter`` (trained by the user's fp
            optimizer with the biases) instead of a buffer.
        zero_fraction: Flip mode, ternary: initialise the codes with this share of zeros per scale group (the
            ``zero_fraction`` quantile of ``|W|`` is cut to 0); None: absmean rounding (about 25% zeros for a uniform
            init).

    Returns:
        ``module`` (or the converted layer when ``module`` itself is a supported layer).

    Raises:
        ValueError: A type in ``include`` is not supported, or an invalid kind / mode / granularity.
    """
    validate_kind(kind)
    validate_mode(mode)
    validate_granularity(granularity)
    if trainable_scale and mode != "flip":
        raise ValueError("trainable_scale=True needs mode='flip'.")
    wanted = _resolve_include(include)
    conv1d = _conv1d_type() if "Conv1D" in wanted else None

    def dense_args(weight: Tensor, bias: Tensor | None) -> tuple:
        return weight, bias, kind, mode, granularity, trainable_scale, zero_fraction

    def replacement(child: nn.Module) -> nn.Module | None:
        if type(child) is nn.Linear and "Linear" in wanted:
            return _LINEAR_CLASS[kind].from_dense(*dense_args(child.weight, child.bias))
        if conv1d is not None and type(child) is conv1d:
            return _LINEAR_CLASS[kind].from_dense(
                child.weight.t(), child.bias, kind, mode, granularity, trainable_scale
            )
        if type(child) is nn.Conv2d and "Conv2d" in wanted:
            return _CONV_CLASS[kind].from_conv2d(child, kind, mode, granularity, trainable_scale, zero_fraction)
        return None

    root = replacement(module)
    if root is not None:
        return root
    for name, child in list(module.named_modules()):
        if not name or _skipped(name, skip):
            continue
        new = replacement(child)
        if new is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        new.train(child.training)
        setattr(parent, attr, new)
    return module
