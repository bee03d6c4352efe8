"""Moving MatFormer training state between the full (tier-0) shapes and a rank's prefix shapes.

The strategies keep one checkpoint format: the full model and full optimizer state of global rank 0, which is
always tier 0. Every holder of a coordinate receives the same aggregated gradient (one all-reduce per rank set), so
each rank's weights and optimizer moments are exactly the prefix of rank 0's. A tier-``t`` rank therefore resumes by
slicing what it loads:

- :func:`slice_model_state` cuts a full model state dict to the rank's widths (``prefix_state_dict``);
- :func:`slice_optimizer_state` cuts every optimizer state tensor shaped like its FFN parameter along the FFN axis;
- :func:`grow_to_full` goes back: it gives a sliced module full-size FFN parameters again (filled by the caller,
  e.g. with rank 0's values), so that ``validate``/``test`` after ``fit`` see one full model on every rank.

Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hetero.matformer.adapters import (
    BASE_SIZE_KEY,
    TIER_KEY,
    WIDTHS_KEY,
    FFNBlock,
    UnsupportedModelError,
    intermediate_size_field,
)
from lightning_hetero.matformer.prefix_state import prefix_state_dict
from lightning_hetero.matformer.slicing import _hf_configs
from lightning_hetero.matformer.types import FFNParameter

__all__ = ["grow_to_full", "slice_model_state", "slice_optimizer_state"]


def slice_model_state(
    full_state: Mapping[str, Tensor], ffn_params: Sequence[FFNParameter], widths: Sequence[int]
) -> dict[str, Tensor]:
    """A full model state dict cut to per-FFN ``widths`` (FFN ``i`` keeps ``widths[i]`` units).

    Entries that already have the local size along their FFN axis (a sliced checkpoint of the same tier) are kept
    as they are, so loading a state dict written by the rank itself also works.

    Raises:
        ValueError: an FFN entry is neither full size nor the local size.
    """
    by_layer = {param.layer: param for param in ffn_params}
    width_of = {param.name: widths[param.layer] for param in ffn_params}
    if sorted(by_layer) != list(range(len(widths))):
        raise ValueError(f"widths has {len(widths)} entries but ffn_params describe FFNs {sorted(by_layer)}.")
    local = {
        spec.name
        for spec in ffn_params
        if spec.name in full_state and full_state[spec.name].shape[spec.axis] == width_of[spec.name]
    }
    specs = [spec for spec in ffn_params if spec.name not in local]
    if not specs:
        return dict(full_state)
    layer_widths = [widths[layer] for layer in sorted({p.layer for p in specs})]
    sliced = prefix_state_dict({k: v for k, v in full_state.items() if k not in local}, specs, widths=layer_widths)
    return {key: full_state[key] if key in local else sliced[key] for key in full_state}


def slice_optimizer_state(
    state: Mapping[str, Any], optimizer: Optimizer, module: nn.Module, ffn_params: Sequence[FFNParameter]
) -> dict[str, Any]:
    """An optimizer state dict of the full model, cut to fit ``optimizer``, whose FFN parameters are prefixes.

    Saved and current parameters are matched the way ``Optimizer.load_state_dict`` matches them: by position in the
    param groups. Every state tensor with the full parameter's shape (AdamW's ``exp_avg``/``exp_avg_sq``, SGD's
    momentum, ...) is narrowed along the parameter's FFN axis to the current size; scalars such as ``step`` and
    parameters outside the FFNs are passed through.

    Args:
        state: ``optimizer.state_dict()`` of the full model (rank 0's).
        optimizer: This rank's optimizer, built on the sliced parameters of ``module``.
        module: The module whose ``named_parameters()`` names the FFN parameters as in ``ffn_params``.
        ffn_params: The FFN parameters of the full model.

    Raises:
        ValueError: the param groups differ in number or length, or a state tensor fits neither shape.
    """
    saved_groups, groups = state["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, groups, strict=True)
    ):
        raise ValueError(
            "The checkpoint's optimizer has param groups of sizes "
            f"{[len(g['params']) for g in saved_groups]} but this rank's has {[len(g['params']) for g in groups]}; "
            "resume with the same configure_optimizers as the run that saved it."
        )
    names = {id(param): name for name, param in module.named_parameters()}
    specs = {spec.name: spec for spec in ffn_params}
    saved_state = state["state"]
    out_state: dict[Any, Any] = dict(saved_state)
    for saved_group, group in zip(saved_groups, groups, strict=True):
        for saved_id, param in zip(saved_group["params"], group["params"], strict=True):
            spec = specs.get(names.get(id(param), ""))
            if spec is None or saved_id not in saved_state:
                continue
            entry = {}
            for key, value in saved_state[saved_id].items():
                entry[key] = _narrow_like(value, param, spec) if isinstance(value, Tensor) else value
            out_state[saved_id] = entry
    return {**state, "state": out_state}


def _narrow_like(value: Tensor, param: Tensor, spec: FFNParameter) -> Tensor:
    """``value`` narrowed along ``spec.axis`` to ``param``'s size when it has the full parameter's shape."""
    if value.shape == param.shape or value.dim() != param.dim():
        return value
    full_shape = list(param.shape)
    full_shape[spec.axis] = spec.full_size
    if list(value.shape) != full_shape:
        raise ValueError(
            f"optimizer state of {spec.name} has shape {tuple(value.shape)}; expected the full {tuple(full_shape)} "
            f"or this rank's {tuple(param.shape)}. Resume from a checkpoint of the same model (saved by rank 0)."
        )
    return value.narrow(spec.axis, 0, param.shape[spec.axis]).clone()


def grow_to_full(module: nn.Module, blocks: Sequence[FFNBlock]) -> list[tuple[FFNParameter, nn.Parameter]]:
    """Give every sliced FFN of ``module`` full-size parameters again; returns them for the caller to fill.

    The new parameters hold the old prefix and zeros beyond it; the size attributes that forward reads
    (``Linear.in_features``/``out_features``, ``Conv1D.nf``/``nx``) and the HF configs (FFN size field, the
    ``matformer_*`` metadata) are restored to the full model.

    Args:
        module: A module sliced by ``slice_model`` (or a full one: then nothing changes).
        blocks: ``find_ffns`` of the *full* module (full sizes, parameter names).

    Returns:
        ``(spec, new parameter)`` for every FFN parameter that grew.
    """
    grown = []
    for block in blocks:
        for proj in block.projections:
            sub = module.get_submodule(proj.path)
            for attr, axis in (("weight", proj.weight_axis), ("bias", 0)):
                tensor = getattr(sub, attr, None)
                if tensor is None or (attr == "bias" and proj.role == "output"):
                    continue
                if tensor.shape[axis] == block.full_size:
                    continue
                shape = list(tensor.shape)
                shape[axis] = block.full_size
                full = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
                full.narrow(axis, 0, tensor.shape[axis]).copy_(tensor.detach())
                param = nn.Parameter(full, requires_grad=tensor.requires_grad)
                setattr(sub, attr, param)
                grown.append((FFNParameter(f"{proj.path}.{attr}", axis, block.full_size, block.layer), param))
            _restore_size_attributes(sub, proj.kind, proj.role, block.full_size)
    if grown:
        for config in _hf_configs(module):
            try:
                field = intermediate_size_field(config)
            except UnsupportedModelError:
                continue
            if getattr(config, BASE_SIZE_KEY, None) is not None:
                setattr(config, field, int(getattr(config, BASE_SIZE_KEY)))
            for key in (TIER_KEY, WIDTHS_KEY):
                if hasattr(config, key):
                    delattr(config, key)
    return grown


def _restore_size_attributes(sub: nn.Module, kind: str, role: str, full_size: int) -> None:
    if kind == "conv1d":
        if role == "input":
            sub.nf = full_size
        else:
            sub.nx = full_size
    elif role == "input":
        sub.out_features = full_size
    else:
        sub.in_features = full_size
