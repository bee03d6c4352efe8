"""Who trains which FFN neurons in tiered MatFormer training: pure, deterministic functions.

A rank at tier ``t`` trains the prefix ``[0, h >> t)`` of every FFN hidden axis, or one width per layer
(Mix'n'Match). The distinct widths cut the hidden axis into nested *regions*; a region is trained, and averaged, by
exactly the ranks whose prefix covers it. A helper rank (tier > 0) may also train a seeded, rotating subset of tail
neurons. Every rank computes all of this identically from the static configuration and the step, so none of it is
ever communicated. :mod:`lightning_hetero.matformer.aggregate` turns it into process groups and all-reduces.

This module holds the aggregation modes, the per-rank weights and the byte accounting; the layout
(:mod:`~lightning_hetero.matformer.layout`), regions (:mod:`~lightning_hetero.matformer.regions`) and helper draws
(:mod:`~lightning_hetero.matformer.helper_ranks`) it builds on live in their own modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TypedDict

import torch
from typing_extensions import Unpack

from lightning_hetero.comm.ledger import wire_bytes
from lightning_hetero.matformer.helper_ranks import HelperConfig, drawn_neurons
from lightning_hetero.matformer.layout import TierLayout
from lightning_hetero.matformer.regions import layer_regions
from lightning_hetero.matformer.types import FFNParameter

__all__ = [
    "MODES",
    "BucketOptions",
    "TierWeights",
    "bucket_numels",
    "bytes_per_step",
    "check_mode",
    "contributor_counts",
    "contributor_weights",
    "rank_weights",
    "wire_dtype",
]

MODES = ("mean", "sign", "demo")
"""Aggregation modes: per-region mean, sign vote, or the mean through the DeMo replicator (compressed.py)."""

TierWeights = Mapping[int, float] | Sequence[float]
"""Weight of each tier's contribution: ``{tier: weight}`` or a sequence indexed by tier."""


class BucketOptions(TypedDict, total=False):
    """The keyword options of :func:`bucket_numels`, which :func:`bytes_per_step` passes on (defaults there)."""

    mode: str
    dtypes: torch.dtype | Mapping[str, torch.dtype]
    tier_weights: TierWeights | None
    helpers: Mapping[int, HelperConfig] | None


_INT8_MAX_VOTERS = 127  # an int8 sum of n votes in {-1, 0, 1} cannot overflow while n <= 127


# ---------------------------------------------------------------------------------------------------- weights
def rank_weights(
    layout: TierLayout,
    tier_weights: TierWeights | None,
    layer: int | None = None,
    *,
    rank_scale: Sequence[float] | None = None,
) -> tuple[float, ...]:
    """Weight of every rank's contribution in FFN ``layer``, or for non-FFN parameters when ``layer`` is None.

    A rank's tier is ``layout.tier(rank, layer)``; for non-FFN parameters it is the rank's lowest tier over all
    layers (its widest FFN). Without ``tier_weights`` every tier weight is 1. ``rank_scale`` (one factor per rank,
    e.g. its micro-batch size under a batch share) multiplies each rank's weight.

    Raises:
        ValueError: A width that is no power-of-two fraction of ``h``, a tier missing from ``tier_weights``, a
            weight that is not finite and > 0, or a ``rank_scale`` that is not one such number per rank.
    """
    scale = _check_rank_scale(rank_scale, layout.world_size)
    if tier_weights is None:
        return scale
    out = []
    for rank in range(layout.world_size):
        layers = layout.columns() if layer is None else [layer]
        tiers = [layout.tier(rank, column) for column in layers]
        if None in tiers:
            raise ValueError(
                f"tier_weights need power-of-two widths, but rank {rank} has widths {layout.widths[rank]} of"
                f" {layout.full_sizes}; drop tier_weights or use widths h / 2**t."
            )
        tier = min(tiers)  # type: ignore[type-var]
        try:
            weight = float(tier_weights[tier])  # type: ignore[index]
        except (KeyError, IndexError):
            raise ValueError(f"tier_weights has no weight for tier {tier} (rank {rank}); add one.") from None
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"tier_weights[{tier}] must be finite and > 0, got {weight}.")
        out.append(weight * scale[rank])
    return tuple(out)


def _check_rank_scale(rank_scale: Sequence[float] | None, world_size: int) -> tuple[float, ...]:
    if rank_scale is None:
        return (1.0,) * world_size
    values = tuple(float(v) for v in rank_scale)
    if len(values) != world_size or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"rank_scale={list(rank_scale)}: give one finite factor > 0 per rank ({world_size}), or None.")
    return values


def contributor_weights(
    layout: TierLayout,
    layer: int = 0,
    *,
    tier_weights: TierWeights | None = None,
    helpers: Mapping[int, HelperConfig] | None = None,
    step: int = 0,
    rank_scale: Sequence[float] | None = None,
) -> torch.Tensor:
    """Per neuron of ``layer``, the summed weight of the ranks that trained it at ``step`` (float64, length ``h``).

    This is the denominator of the weighted per-neuron mean; without ``tier_weights`` and ``rank_scale`` it is the
    contributor count.
    """
    weights = rank_weights(layout, tier_weights, layer, rank_scale=rank_scale)
    totals = torch.zeros(layout.full_size_at(layer), dtype=torch.float64)
    for rank in range(layout.world_size):
        totals[: layout.width(rank, layer)] += weights[rank]
        totals[drawn_neurons(layout, rank, layer, helpers=helpers, step=step)] += weights[rank]
    return totals


def contributor_counts(
    layout: TierLayout, layer: int = 0, *, helpers: Mapping[int, HelperConfig] | None = None, step: int = 0
) -> torch.Tensor:
    """Per neuron of ``layer``, how many ranks trained it at ``step`` (int64, length ``h``)."""
    return contributor_weights(layout, layer, helpers=helpers, step=step).round().to(torch.int64)


# ---------------------------------------------------------------------------------------------------- bytes
def check_mode(mode: str) -> str:
    """Return ``mode`` if it is one of :data:`MODES`; raise a clear error otherwise."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}.")
    return mode


def wire_dtype(mode: str, grad_dtype: torch.dtype, weighted: bool, group_size: int) -> torch.dtype:
    """The dtype a bucket is built in: the gradient dtype for ``mean`` and ``demo`` (which then packs DCT top-k bytes);
    int8 votes for ``sign`` (float32 if weighted, int32 beyond 127 voters)."""
    if check_mode(mode) != "sign":
        return grad_dtype
    if weighted:
        return torch.float32
    return torch.int8 if group_size <= _INT8_MAX_VOTERS else torch.int32


def bucket_numels(
    layout: TierLayout,
    ffn_params: Sequence[FFNParameter],
    param_shapes: Mapping[str, Sequence[int]],
    *,
    mode: str = "mean",
    dtypes: torch.dtype | Mapping[str, torch.dtype] = torch.float32,
    tier_weights: TierWeights | None = None,
    helpers: Mapping[int, HelperConfig] | None = None,
) -> dict[tuple[tuple[int, ...], torch.dtype], int]:
    """Elements of every all-reduce bucket, keyed by ``(member ranks, wire dtype)``: one all-reduce each per step.

    ``param_shapes`` holds the full (tier-0) shape of every parameter that has a gradient; the names listed in
    ``ffn_params`` are split into regions, the others are exchanged whole among all ranks.
    """
    everyone = tuple(range(layout.world_size))
    weighted = tier_weights is not None
    ffn = {param.name: param for param in ffn_params}
    buckets: dict[tuple[tuple[int, ...], torch.dtype], int] = {}

    def add(members: tuple[int, ...], name: str, numel: int) -> None:
        grad_dtype = dtypes if isinstance(dtypes, torch.dtype) else dtypes[name]
        key = (members, wire_dtype(mode, grad_dtype, weighted, len(members)))
        buckets[key] = buckets.get(key, 0) + numel

    for name, shape in param_shapes.items():
        numel = math.prod(shape)
        if name not in ffn:
            add(everyone, name, numel)
            continue
        param = ffn[name]
        if shape[param.axis] != param.full_size:
            raise ValueError(
                f"param_shapes[{name!r}] = {tuple(shape)} is not full size {param.full_size} on axis {param.axis}."
            )
        for region in layer_regions(layout, param.layer, helpers):
            add(region.members, name, region.size * numel // param.full_size)
    return buckets


def bytes_per_step(
    layout: TierLayout,
    ffn_params: Sequence[FFNParameter],
    param_shapes: Mapping[str, Sequence[int]],
    **options: Unpack[BucketOptions],
) -> list[int]:
    """Bytes each rank sends (and, equally, receives) per step under the ledger's all-reduce rule.

    Per bucket of ``n`` members and ``S`` bytes, each member moves ``2 * (n - 1) * S // n`` each way
    (:func:`~lightning_hetero.comm.ledger.wire_bytes`); a rank's total is the sum over the buckets it belongs to.
    Arguments as for :func:`bucket_numels` (``options``: :class:`BucketOptions`). Returns one count per rank. For
    ``mode="demo"`` use :func:`~lightning_hetero.matformer.compressed.demo_bytes_per_step`.
    """
    if options.get("mode") == "demo":
        raise ValueError("bytes_per_step counts all-reduces; for mode='demo' use compressed.demo_bytes_per_step.")
    totals = [0] * layout.world_size
    buckets = bucket_numels(layout, ffn_params, param_shapes, **options)
    for (members, dtype), numel in buckets.items():
        sent, _ = wire_bytes("all_reduce", numel * torch.empty(0, dtype=dtype).element_size(), len(members))
        for rank in members:
            totals[rank] += sent
    return totals
