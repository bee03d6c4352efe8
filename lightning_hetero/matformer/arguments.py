"""Argument checks of the MatFormer strategies (tier entries, tier weights) and the schema every rank compares."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from lightning_hetero.matformer.schema import canonical_schema

__all__ = [
    "TierEntry",
    "as_list",
    "check_entries",
    "check_helper_arguments",
    "check_tier_weights",
    "expand_entries",
    "module_schema",
]

TierEntry = int | list[int]
"""One rank's (or node's) tier or width: one value for every FFN, or one per FFN (Mix'n'Match)."""


def expand_entries(
    owner: str, unit: str, entries: Sequence[TierEntry] | None, world_size: int, num_nodes: int
) -> list[TierEntry]:
    """One entry per global rank: given per rank, or per node (node ``k`` holds ranks ``[kP, (k+1)P)``)."""
    name = "tiers" if unit == "tier" else "widths"
    if entries is None:
        return [0] * world_size
    if len(entries) == world_size:
        return list(entries)
    if num_nodes >= 1 and len(entries) == num_nodes and world_size % num_nodes == 0:
        per_node = world_size // num_nodes
        return [entry for entry in entries for _ in range(per_node)]
    raise ValueError(
        f"{owner}({name}={list(entries)}): {len(entries)} entries, but the run has "
        f"{world_size} ranks ({num_nodes} node(s) x {world_size // max(num_nodes, 1)} devices). Give one entry "
        f"per global rank ({world_size}) or one per node ({num_nodes})."
    )


def as_list(entry: Any) -> list[Any]:
    return [entry] if isinstance(entry, int) else list(entry)


def check_entries(owner: str, unit: str, entries: Any) -> list[TierEntry]:
    name, low = ("tiers", 0) if unit == "tier" else ("widths", 1)
    if isinstance(entries, (int, str)) or not isinstance(entries, Sequence) or not entries:
        raise ValueError(f"{owner}({name}={entries!r}): give a non-empty list, one entry per rank or per node.")
    out: list[TierEntry] = []
    for index, entry in enumerate(entries):
        values = [entry] if not isinstance(entry, Sequence) or isinstance(entry, str) else list(entry)
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
            raise ValueError(
                f"{owner}({name}={list(entries)}): entry {index} ({entry!r}) must be an int >= {low} or a non-empty "
                f"list of such ints (one per FFN)."
            )
        out.append(values[0] if isinstance(entry, int) else values)
    return out


def check_tier_weights(owner: str, weights: Any, unit: str, entries: Sequence[TierEntry] | None) -> list[float]:
    if isinstance(weights, (str, Mapping)) or not isinstance(weights, Sequence) or not weights:
        raise ValueError(f"{owner}(tier_weights={weights!r}): give a list with one weight per tier (index = tier).")
    values = []
    for tier, weight in enumerate(weights):
        number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not (number and math.isfinite(weight) and weight > 0):
            raise ValueError(f"{owner}(tier_weights={list(weights)}): weight {tier} must be finite and > 0.")
        values.append(float(weight))
    if unit == "tier" and entries is not None:
        highest = max(max(as_list(entry)) for entry in entries)
        if highest >= len(values):
            raise ValueError(
                f"{owner}(tier_weights={values}): {len(values)} weight(s) for tiers 0..{len(values) - 1}, but tiers "
                f"uses tier {highest}; give one weight per tier 0..{highest}."
            )
    return values


def module_schema(module: nn.Module) -> dict[str, Any]:
    """The canonical tier-0 schema of the HF model(s) in ``module``, or its parameter shapes if it holds none."""
    outermost: list[tuple[str, PreTrainedModel]] = []
    for path, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel) and not any(path.startswith(p + ".") for p, _ in outermost):
            outermost.append((path, sub))
    if len(outermost) == 1:
        return canonical_schema(outermost[0][1].config)
    if outermost:
        return {path or "<root>": canonical_schema(model.config) for path, model in outermost}
    return {"parameters": {name: list(p.shape) for name, p in module.named_parameters()}}


def check_helper_arguments(
    owner: str, helper_fraction: Any, helper_redraw_every: Any, helper_seed: Any, slice_weights: bool
) -> None:
    """Helpers (tail neurons a tier > 0 rank also trains) need full weights and sane draw settings."""
    if not (isinstance(helper_fraction, (int, float)) and math.isfinite(helper_fraction) and helper_fraction >= 0):
        raise ValueError(f"{owner}(helper_fraction={helper_fraction!r}): use a number >= 0 (0 turns helpers off).")
    if helper_fraction > 0 and slice_weights:
        raise ValueError(
            f"{owner}(helper_fraction={helper_fraction}, slice_weights=True): a helper trains tail neurons beyond "
            "its prefix, so it must keep the full weights; set slice_weights=False (or helper_fraction=0)."
        )
    if isinstance(helper_redraw_every, bool) or not isinstance(helper_redraw_every, int) or helper_redraw_every < 1:
        raise ValueError(f"{owner}(helper_redraw_every={helper_redraw_every!r}): use an int >= 1.")
    if isinstance(helper_seed, bool) or not isinstance(helper_seed, int):
        raise ValueError(f"{owner}(helper_seed={helper_seed!r}): use an int.")
