"""Moving FFN weights between a tier's prefix shape and the full shape, on state dicts and tensors.

``prefix_state_dict`` slices a full checkpoint to a tier without building the full model; ``pad_prefix`` and
``embed_prefix`` put a prefix back into the full shape (zero suffix / kept suffix); ``scatter_prefix_into_full``
writes a sliced model's state dict into full-width weights. The model-level slicing (``slice_model``, ``tier_view``)
is in :mod:`lightning_hetero.matformer.slicing`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from lightning_hetero.matformer.types import FFNParameter, tier_width

__all__ = ["embed_prefix", "pad_prefix", "prefix_state_dict", "scatter_prefix_into_full"]


def _widths_per_layer(
    ffn_params: Sequence[FFNParameter], tier: int | None, widths: Sequence[int] | None
) -> dict[int, int]:
    """The kept width of each FFN (by ``FFNParameter.layer``) from a tier or explicit per-FFN widths."""
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
