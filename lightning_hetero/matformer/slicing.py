"""Prefix slicing of nested FFNs: physical slices, prefix views over full weights, and checkpoint helpers.

A tier ``t`` keeps the first ``w = h >> t`` hidden units of every FFN (or a width per FFN, Mix'n'Match)::

    FFN_w(x) = W_out[:, :w] · act(W_in[:w, :] x + b_in[:w]) + b_out        (gated: act(W_gate[:w] x) * (W_up[:w] x))

``slice_model`` cuts the weights to that prefix for good (smaller parameters, smaller memory). ``tier_view`` keeps
the full parameters and runs the same prefix math on views of them, so autograd writes into the prefix of the full
``.grad`` and leaves the suffix exactly zero. ``prefix_state_dict`` / ``scatter_prefix_into_full`` move weights
between the two shapes without building models.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
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
from lightning_hetero.matformer.types import FFNParameter, tier_width


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


def _widths_per_layer(
    ffn_params: Sequence[FFNParameter], tier: int | None, widths: Sequence[int] | None
) -> dict[int, int]:
    full_by_layer = {p.layer: p.full_size for p in ffn_params}
    if tier is not None and widths is None:
        return {layer: tier_width(full, tier) for layer, full in full_by_layer.items()}
    if tier is not None or widths is None:
        raise ValueError("Pass exactly one of tier=<int> or widths=[...] (one width per FFN).")
    layers = sorted(full_by_layer)
    if len(widths) != len(layers):
        raise ValueError(f"widths has {len(widths)} entries but ffn_params describe {len(layers)} FFNs.")
    out = dict(zip(layers, widths, strict=True))
    for layer, width in out.items():
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= full_by_layer[layer]:
            raise ValueError(f"widths[{layer}] must be an int in [1, {full_by_layer[layer]}], got {width!r}.")
    return out


def prefix_state_dict(
    full_state_dict: Mapping[str, Tensor],
    ffn_params: Sequence[FFNParameter],
    tier: int | None = None,
    widths: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """Slice a full checkpoint to a tier without building the full model.

    ``ffn_params`` can come from a model built on the meta device (``with torch.device("meta"):
    AutoModelForCausalLM.from_config(config)``), which allocates nothing. Entries that are not FFN parameters are
    passed through unchanged (same tensor objects); sliced ones are contiguous copies.

    Args:
        full_state_dict: State dict of the full (tier-0) model.
        ffn_params: ``ffn_parameters(model)`` of a full model of the same architecture (names must match the keys).
        tier: Keep ``full_size >> tier`` units.
        widths: Per-FFN widths instead (indexed by ``FFNParameter.layer``).

    Raises:
        KeyError: an FFN parameter is missing from the state dict.
        ValueError: a tensor is not full-size along its FFN axis, or the tier/widths are invalid.
    """
    per_layer = _widths_per_layer(ffn_params, tier, widths)
    specs = {p.name: p for p in ffn_params}
    missing = sorted(set(specs) - set(full_state_dict))
    if missing:
        raise KeyError(
            f"{len(missing)} FFN parameters are not in the state dict, e.g. {missing[:3]}; build ffn_params from a "
            "model whose parameter names match the checkpoint keys (same wrapper prefix)."
        )
    out: dict[str, Tensor] = {}
    for key, tensor in full_state_dict.items():
        spec = specs.get(key)
        if spec is None:
            out[key] = tensor
            continue
        if tensor.shape[spec.axis] != spec.full_size:
            raise ValueError(
                f"{key} has size {tensor.shape[spec.axis]} along its FFN axis {spec.axis}, expected the full size "
                f"{spec.full_size}; prefix_state_dict needs a full (tier-0) checkpoint."
            )
        out[key] = tensor.narrow(spec.axis, 0, per_layer[spec.layer]).clone()
    return out


def pad_prefix(prefix: Tensor, full_size: int, axis: int) -> Tensor:
    """A zero tensor of the full shape with ``prefix`` in its leading slice along ``axis`` (a tier's grad -> full)."""
    if not -prefix.dim() <= axis < prefix.dim():
        raise ValueError(f"axis {axis} is out of range for a {prefix.dim()}-d tensor.")
    if prefix.shape[axis] > full_size:
        raise ValueError(f"prefix has {prefix.shape[axis]} units along axis {axis}, more than full_size {full_size}.")
    shape = list(prefix.shape)
    shape[axis] = full_size
    full = prefix.new_zeros(shape)
    full.narrow(axis, 0, prefix.shape[axis]).copy_(prefix)
    return full


def embed_prefix(full_param: Tensor, prefix_param: Tensor, axis: int) -> Tensor:
    """Write ``prefix_param`` into the leading slice of ``full_param`` along ``axis``, in place; the suffix is kept.

    Returns:
        ``full_param``.

    Raises:
        ValueError: the shapes differ off ``axis`` or the prefix is longer than the full tensor.
    """
    if full_param.dim() != prefix_param.dim() or not -full_param.dim() <= axis < full_param.dim():
        raise ValueError(
            f"embed_prefix needs tensors of the same rank and a valid axis; got {tuple(full_param.shape)}, "
            f"{tuple(prefix_param.shape)}, axis={axis}."
        )
    off_axis_full = [s for i, s in enumerate(full_param.shape) if i != axis % full_param.dim()]
    off_axis_prefix = [s for i, s in enumerate(prefix_param.shape) if i != axis % full_param.dim()]
    if off_axis_full != off_axis_prefix or prefix_param.shape[axis] > full_param.shape[axis]:
        raise ValueError(
            f"Cannot embed a {tuple(prefix_param.shape)} prefix into {tuple(full_param.shape)} along axis {axis}: "
            "the other axes must match and the prefix must not be longer."
        )
    with torch.no_grad():
        full_param.narrow(axis, 0, prefix_param.shape[axis]).copy_(prefix_param)
    return full_param


def scatter_prefix_into_full(
    full: nn.Module | Mapping[str, Tensor],
    prefix_state: Mapping[str, Tensor],
    ffn_params: Sequence[FFNParameter],
) -> None:
    """Write a tier's weights (a sliced model's state dict) into full-width tensors, in place.

    FFN parameters are embedded into their prefix (the full suffix is kept); every other entry is copied whole.

    Args:
        full: The full model (its ``state_dict(keep_vars=True)`` is written) or a mapping of full tensors.
        prefix_state: State dict of the sliced model (keys as in the full model).
        ffn_params: ``ffn_parameters`` of the full model.

    Raises:
        KeyError: a key of ``prefix_state`` is not in ``full``.
        ValueError: a shape does not fit.
    """
    targets = full.state_dict(keep_vars=True) if isinstance(full, nn.Module) else full
    specs = {p.name: p for p in ffn_params}
    unknown = sorted(set(prefix_state) - set(targets))
    if unknown:
        raise KeyError(f"{len(unknown)} keys of prefix_state are not in the full model, e.g. {unknown[:3]}.")
    with torch.no_grad():
        for key, tensor in prefix_state.items():
            spec = specs.get(key)
            if spec is not None:
                embed_prefix(targets[key], tensor, spec.axis)
            elif targets[key].shape != tensor.shape:
                raise ValueError(
                    f"{key} is {tuple(tensor.shape)} in prefix_state but {tuple(targets[key].shape)} in the full "
                    "model, and it is not an FFN parameter."
                )
            else:
                targets[key].copy_(tensor)
