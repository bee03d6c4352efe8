"""Prefix slicing of nested FFNs: physical slices, prefix views over full weights, and checkpoint helpers.

A tier ``t`` keeps the first ``w = h >> t`` hidden units of every FFN (or a width per FFN, Mix'n'Match)::

    FFN_w(x) = W_out[:, :w] · act(W_in[:w, :] x + b_in[:w]) + b_out        (gated: act(W_gate[:w] x) * (W_up[:w] x))

``slice_model`` cuts the weights to that prefix for good (smaller parameters, smaller memory). ``tier_view`` keeps
the full parameters and runs the same prefix math on views of them, so autograd writes into the prefix of the full
``.grad`` and leaves the suffix exactly zero. ``prefix_state_dict`` / ``scatter_prefix_into_full`` (and ``pad_prefix``,
``embed_prefix``) move weights between the two shapes without building models; they live in
:mod:`lightning_hetero.matformer.prefix_state`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.hooks import RemovableHandle
from transformers import PretrainedConfig

from lightning_hetero.matformer.adapters import (
    BASE_SIZE_KEY,
    FULL_SIZE_ATTR,
    TIER_KEY,
    WIDTHS_KEY,
    FFNBlock,
    Projection,
    UnsupportedModelError,
    find_ffns,
    intermediate_size_field,
)
from lightning_hetero.matformer.types import tier_width

__all__ = ["apply_widths", "mask_suffix_gradients", "resolve_widths", "slice_model", "tier_view"]


def resolve_widths(
    blocks: Sequence[FFNBlock], tier: int | None = None, widths: Sequence[int] | None = None
) -> list[int]:
    """One target width per FFN from either a tier or explicit per-FFN widths.

    Args:
        blocks: FFNs of the model (``find_ffns``).
        tier: Keep ``full_size >> tier`` units of every FFN.
        widths: Keep ``widths[i]`` units of FFN ``i`` (Mix'n'Match); any value in ``[1, full_size]``.

    Raises:
        ValueError: both or neither of ``tier``/``widths`` given, a wrong number of widths, a width out of range, or a
            width above what an already sliced model still holds.
    """
    if (tier is None) == (widths is None):
        raise ValueError(
            "Pass exactly one of tier=<int> (uniform width h >> tier) or widths=[w_0, w_1, ...] (per FFN)."
        )
    if widths is None:
        if isinstance(tier, bool) or not isinstance(tier, int):
            raise ValueError(f"tier must be an int >= 0, got {tier!r}.")
        targets = [tier_width(block.full_size, tier) for block in blocks]
    else:
        targets = list(widths)
        if len(targets) != len(blocks):
            raise ValueError(
                f"widths has {len(targets)} entries but the model has {len(blocks)} FFNs; give one width per FFN "
                "(T5: encoder FFNs first, then decoder FFNs)."
            )
        for block, width in zip(blocks, targets, strict=True):
            if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= block.full_size:
                raise ValueError(f"widths[{block.layer}] must be an int in [1, {block.full_size}], got {width!r}.")
    for block, width in zip(blocks, targets, strict=True):
        if width > block.width:
            raise ValueError(
                f"FFN {block.layer} ({block.path}) is already sliced to width {block.width} (full {block.full_size}); "
                f"it cannot grow to {width}. Load the full-width weights to use a lower tier."
            )
    return targets


def _slice_projection(module: nn.Module, proj: Projection, width: int) -> None:
    """Replace a projection's parameters by their prefix and fix the size attributes its forward reads."""
    weight = module.weight
    if weight.shape[proj.weight_axis] != width:
        module.weight = nn.Parameter(
            weight.detach().narrow(proj.weight_axis, 0, width).clone(), requires_grad=weight.requires_grad
        )
    bias = module.bias
    if proj.role == "input" and bias is not None and bias.shape[0] != width:
        module.bias = nn.Parameter(bias.detach()[:width].clone(), requires_grad=bias.requires_grad)
    if proj.kind == "conv1d":
        # Conv1D.forward shapes its output with `nf`, so it must follow the weight.
        if proj.role == "input":
            module.nf = width
        else:
            module.nx = width
    elif proj.role == "input":
        module.out_features = width
    else:
        module.in_features = width


def _hf_configs(model: nn.Module) -> list[PretrainedConfig]:
    """Distinct HF configs held by modules of ``model`` (T5 stacks hold their own copies)."""
    configs: dict[int, PretrainedConfig] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            configs.setdefault(id(config), config)
    return list(configs.values())


def _tier_of(full_size: int, width: int) -> int | None:
    """The tier ``t`` with ``full_size >> t == width`` exactly, if there is one."""
    for tier in range(full_size.bit_length()):
        if full_size % (1 << tier) == 0 and full_size >> tier == width:
            return tier
    return None


def apply_widths(model: nn.Module, blocks: Sequence[FFNBlock], widths: Sequence[int]) -> None:
    """Slice the FFNs ``blocks`` of ``model`` to ``widths`` and record it in the module and HF config metadata.

    The low-level step behind ``slice_model`` (which resolves tiers and validates first); ``blocks`` may come from an
    identical model (e.g. the original of a deep copy).
    """
    for block, width in zip(blocks, widths, strict=True):
        if width == block.width:
            continue
        for proj in block.projections:
            _slice_projection(model.get_submodule(proj.path), proj, width)
        setattr(model.get_submodule(block.path), FULL_SIZE_ATTR, block.full_size)
    if all(width == block.full_size for block, width in zip(blocks, widths, strict=True)):
        return
    full_size = blocks[0].full_size
    uniform = len(set(widths)) == 1
    for config in _hf_configs(model):
        try:
            field = intermediate_size_field(config)
        except UnsupportedModelError:
            continue  # a config of a part without our FFNs (or a user family without model_types)
        setattr(config, BASE_SIZE_KEY, full_size)
        if uniform:
            # The config must describe the weights, so save_pretrained/from_pretrained of the result round-trips.
            setattr(config, field, widths[0])
            setattr(config, TIER_KEY, _tier_of(full_size, widths[0]))
            if hasattr(config, WIDTHS_KEY):
                delattr(config, WIDTHS_KEY)
        else:
            # These families hold one FFN size per config, so per-layer widths can only be recorded as metadata.
            setattr(config, WIDTHS_KEY, list(widths))
            if hasattr(config, TIER_KEY):
                delattr(config, TIER_KEY)


def slice_model(model: nn.Module, tier: int | None = None, widths: Sequence[int] | None = None) -> nn.Module:
    """Physically slice every FFN of ``model`` in place to its prefix.

    Input projections keep their first ``w`` output units (weight and bias), the output projection its first ``w``
    input units (weight only). Parameters are replaced by new, smaller ``nn.Parameter`` objects, so build the optimizer
    afterwards. HF configs in the model get the new FFN size (uniform widths) and ``matformer_*`` metadata. Slicing an
    already sliced model is relative to its recorded full size: ``tier`` never slices twice.

    Args:
        model: Module containing FFNs of a registered family.
        tier: Keep ``h >> tier`` units of every FFN.
        widths: Keep ``widths[i]`` units of FFN ``i`` (see ``find_ffns`` for the order).

    Returns:
        ``model`` itself.
    """
    blocks = find_ffns(model)
    apply_widths(model, blocks, resolve_widths(blocks, tier, widths))
    return model


def _prefix_forward(module: nn.Module, proj: Projection, width: int):
    """A forward computing a projection with only the first ``width`` hidden units of its full parameters."""
    if proj.kind == "linear":
        if proj.role == "input":

            def forward(x: Tensor) -> Tensor:
                bias = module.bias[:width] if module.bias is not None else None
                return F.linear(x, module.weight[:width], bias)
        else:

            def forward(x: Tensor) -> Tensor:
                return F.linear(x, module.weight[:, :width], module.bias)

        return forward

    def conv1d_forward(x: Tensor) -> Tensor:
        # Conv1D: y = x @ W + b with W stored [in, out].
        if proj.role == "input":
            weight, bias = module.weight[:, :width], module.bias[:width] if module.bias is not None else None
        else:
            weight, bias = module.weight[:width], module.bias
        out = x.reshape(-1, x.shape[-1]) @ weight
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], weight.shape[1])

    return conv1d_forward


@contextmanager
def tier_view(model: nn.Module, tier: int | None = None, widths: Sequence[int] | None = None) -> Iterator[nn.Module]:
    """Run ``model`` at a tier on its full parameters: FFN projections use prefix views of their weights.

    Parameters stay registered and full-size (optimizers, DDP and ``state_dict`` see no change); only the projections'
    ``forward`` is swapped for the prefix math. Gradients flow into the prefix of each full parameter and the suffix of
    its ``.grad`` is exactly zero. The forward equals that of ``slice_model(copy, tier)``.

    Args:
        model: Module containing FFNs of a registered family (full or already sliced).
        tier: Tier to run (``h >> tier`` units per FFN).
        widths: Per-FFN widths instead of a tier.

    Yields:
        ``model``.

    Raises:
        RuntimeError: a projection's ``forward`` is already patched (nested ``tier_view``, or accelerate hooks from a
            ``device_map``; load the model without ``device_map``).
    """
    blocks = find_ffns(model)
    targets = resolve_widths(blocks, tier, widths)
    patched: list[nn.Module] = []
    try:
        for block, width in zip(blocks, targets, strict=True):
            if width == block.width:
                continue
            for proj in block.projections:
                module = model.get_submodule(proj.path)
                if "forward" in module.__dict__:
                    raise RuntimeError(
                        f"{proj.path}.forward is already patched on the instance (a nested tier_view, or accelerate "
                        "hooks from device_map); tier_view needs the plain module forward."
                    )
                module.forward = _prefix_forward(module, proj, width)
                patched.append(module)
        yield model
    finally:
        for module in patched:
            del module.forward  # drop the instance attribute; the class forward is back


def mask_suffix_gradients(
    model: nn.Module, tier: int | None = None, widths: Sequence[int] | None = None
) -> list[RemovableHandle]:
    """Zero the suffix of every FFN parameter's gradient with tensor hooks (training a prefix of full weights).

    With ``tier_view`` the suffix gradient is already exactly zero; these hooks enforce it for any forward (e.g. a
    full-width auxiliary loss). Call ``handle.remove()`` on each returned handle to undo.
    """
    blocks = find_ffns(model)
    targets = resolve_widths(blocks, tier, widths)
    params = dict(model.named_parameters())
    handles = []
    for block, width in zip(blocks, targets, strict=True):
        for spec in block.parameters:
            param = params[spec.name]
            size = param.shape[spec.axis]
            if width == size:
                continue

            def zero_suffix(grad: Tensor, axis: int = spec.axis, width: int = width, size: int = size) -> Tensor:
                grad = grad.clone()
                grad.narrow(axis, width, size - width).zero_()
                return grad

            handles.append(param.register_hook(zero_suffix))
    return handles
