"""Per-region gradient aggregation for tiered MatFormer training, through the counted collectives only.

Each FFN region (see :func:`~lightning_hetero.matformer.regions.regions`) is all-reduced among exactly the ranks that
hold it, over one process group per distinct rank set (:class:`RegionGroups`), so a tier-``t`` rank moves only the
bytes of what it holds. All pieces that share a rank set (and wire dtype) travel in one flat bucket: one all-reduce
per group per step. Non-FFN gradients join the all-ranks bucket. Modes:

- ``mean``: ``sum_i w_i g_i / sum_i w_i`` per coordinate over the ranks that trained it (``w_i = 1`` by default);
- ``sign``: majority vote, ``sign(sum_i w_i sign(g_i))``; untrained coordinates vote 0, so nothing turns into +1;
- ``demo``: ``mean`` with each bucket sent as DCT top-k with error feedback (:mod:`.compressed`), all-gathered among
  the bucket's ranks.

Helper ranks join the groups of every region in their tail, send zeros where they did not train, and divide by
per-neuron contributor weights that every rank computes locally (no count tensor travels). See
``docs/matformer_aggregation.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_hetero import comm
from lightning_hetero.comm import INTER, ByteLedger
from lightning_hetero.comm.validation import PeerPayloadError, check_finite, report_dropped, validate_on_bad_payload
from lightning_hetero.matformer.helper_ranks import HelperConfig, drawn_neurons, validate_helpers
from lightning_hetero.matformer.layout import TierLayout
from lightning_hetero.matformer.region_groups import GradientExchange, RegionGroups
from lightning_hetero.matformer.tiers import TierWeights, check_mode, contributor_weights, rank_weights, wire_dtype
from lightning_hetero.matformer.types import FFNParameter

__all__ = ["aggregate_gradients"]


@dataclass
class _Piece:
    """One slab of one gradient in a bucket, and how to put the reduced result back."""

    grad: torch.Tensor
    axis: int | None  # None: the whole tensor (non-FFN)
    start: int
    stop: int
    weight: float  # this rank's weight w_i for this slab
    denominator: float | torch.Tensor  # summed contributor weights: a scalar, or one per neuron of the slab
    region_positions: torch.Tensor | None = None  # helper slab: positions (in the region) of the trained neurons...
    grad_positions: torch.Tensor | None = None  # ...and where they sit in ``grad``
    write_whole_slab: bool = True  # False for a helper with local (prefix + drawn) layout: only drawn neurons exist

    def source(self) -> torch.Tensor:
        return self.grad if self.axis is None else self.grad.narrow(self.axis, self.start, self.stop - self.start)

    def shape(self) -> torch.Size:
        if self.axis is None:
            return self.grad.shape
        shape = list(self.grad.shape)
        shape[self.axis] = self.stop - self.start
        return torch.Size(shape)

    def gather(self, view: torch.Tensor, sign: bool) -> None:
        """Write this rank's contribution (its vote for ``sign``) into ``view``; untrained neurons contribute 0."""
        if self.region_positions is None:
            contribution = self.source()
            view.copy_(torch.sign(contribution) if sign else contribution)
        else:  # a helper: only its drawn neurons, zeros elsewhere in the region
            picked = self.grad.index_select(self.axis, self.grad_positions)
            picked = (torch.sign(picked) if sign else picked).to(view.dtype)
            view.zero_().index_copy_(self.axis, self.region_positions, picked)
        if self.weight != 1.0:
            view.mul_(self.weight)

    def scatter(self, view: torch.Tensor, sign: bool) -> None:
        """Turn the reduced sum in ``view`` into the result and write it back into the gradient."""
        result = torch.sign(view) if sign else view.div_(self._broadcast_denominator(view))
        if self.write_whole_slab:
            self.source().copy_(result)
        else:
            picked = result.index_select(self.axis, self.region_positions).to(self.grad.dtype)
            self.grad.index_copy_(self.axis, self.grad_positions, picked)

    def _broadcast_denominator(self, view: torch.Tensor) -> float | torch.Tensor:
        if not isinstance(self.denominator, torch.Tensor):
            return self.denominator
        shape = [1] * view.dim()
        shape[self.axis] = -1
        # A neuron nobody trained (only possible in a helpers-only region) has a zero sum: divide by 1, keep 0.
        safe = torch.where(self.denominator > 0, self.denominator, torch.ones_like(self.denominator))
        return safe.to(device=view.device, dtype=view.dtype).view(shape)


def aggregate_gradients(
    grads: Mapping[str, torch.Tensor],
    ffn_params: Sequence[FFNParameter],
    layout: TierLayout | RegionGroups,
    mode: str = "mean",
    tier_weights: TierWeights | None = None,
    helpers: Mapping[int, HelperConfig] | None = None,
    *,
    step: int | None = None,
    label: str | None = None,
    ledger: ByteLedger | None = None,
    exchange: GradientExchange | None = None,
    on_bad_payload: str = "raise",
    rank_scale: Sequence[float] | None = None,
) -> None:
    """Replace this rank's gradients in place by their per-region aggregate over the ranks that trained them.

    Args:
        grads: This rank's gradients by parameter name; every tensor must be floating point. FFN gradients may be
            in the local layout (size along ``axis`` = the rank's width, plus its drawn helper neurons in
            ascending order for a helper) or full size (tier-0 shape: only the coordinates the rank exchanges are
            read and replaced, the rest is left as it is). Every other entry is a non-FFN gradient, averaged over
            all ranks; every rank must pass the same non-FFN names and shapes (use zeros for missing grads).
        ffn_params: The FFN parameters (names as in ``grads``, full sizes, axes, layers).
        layout: The run's :class:`TierLayout`, or better the :class:`RegionGroups` built once at setup (a bare
            layout creates new process groups on every call, which is collective and slow).
        mode: ``"mean"``, ``"sign"`` or ``"demo"`` (``mean`` through DCT top-k with error feedback; needs
            ``exchange``, no helpers).
        tier_weights: Weight of each tier's contribution (``{tier: w}`` or a list by tier); None weighs ranks
            equally. For non-FFN parameters a rank counts with its lowest tier.
        helpers: Helper configs by rank; must match those of ``layout`` when that is a :class:`RegionGroups`.
        step: Optimizer step, which selects the helpers' draw; required when helpers are active.
        label: Ledger label (default: the groups' label, ``"inter"``).
        ledger: Ledger to record into (default: the global one). ``demo`` buckets are recorded by the replicators
            into the global ledger as ``"inter"`` (use ``comm.get_ledger().capture()`` to see one call's bytes).
        exchange: The :class:`~lightning_hetero.matformer.compressed.CompressedExchange` built once at setup on
            the same groups (it holds the error-feedback buffers); required for, and only for, ``mode="demo"``.
        on_bad_payload: A non-finite all-reduced bucket (some member sent NaN/Inf): ``"raise"`` a
            :class:`~lightning_hetero.comm.validation.PeerPayloadError` on every member, or ``"drop"`` it (those
            coordinates get a zero gradient this step on every member; logged). ``demo`` buckets follow the
            exchange's own policy.
        rank_scale: One factor > 0 per rank that multiplies its weight (times its tier weight), e.g. its micro-batch
            size under a batch share: a region's mean is then ``sum n_r g_r / sum n_r`` over the ranks that hold it,
            the token-weighted mean (:mod:`lightning_hetero.hetero.batch_share`). None: factor 1.

    Raises:
        ValueError: Missing, non-floating or wrongly sized gradients, layout mismatches, bad weights or helpers;
            ``demo`` without an exchange, with helpers, or with a custom label or ledger.
        PeerPayloadError: A non-finite all-reduced bucket under ``on_bad_payload="raise"``.
    """
    check_mode(mode)
    validate_on_bad_payload("aggregate_gradients", on_bad_payload)
    groups = _region_groups(layout, helpers, label)
    layout, helpers = groups.layout, groups.helpers
    demo = mode == "demo"
    if demo:
        _check_demo(groups, exchange, label, ledger)
    elif exchange is not None:
        raise ValueError(f"exchange= is only used by mode='demo', got mode={mode!r}; drop exchange or use 'demo'.")
    if helpers and step is None:
        raise ValueError("aggregate_gradients needs step= (the optimizer step) when helpers are active.")
    step = 0 if step is None else step
    label = groups.label if label is None else label
    buckets = _plan(grads, ffn_params, groups, mode, tier_weights, step, rank_scale)
    sign = mode == "sign"
    pending = []
    for (members, dtype), pieces in sorted(
        buckets.items(), key=lambda item: (-len(item[0][0]), item[0][0], str(item[0][1]))
    ):
        buffer = torch.empty(sum(p.shape().numel() for p in pieces), dtype=dtype, device=pieces[0].grad.device)
        views, offset = [], 0
        for piece in pieces:
            numel = piece.shape().numel()
            views.append(buffer[offset : offset + numel].view(piece.shape()))
            piece.gather(views[-1], sign)
            offset += numel
        handle = None
        if len(members) > 1 and demo:
            assert exchange is not None and all(p.region_positions is None for p in pieces)  # only trained slabs
            handle = exchange.launch(members, buffer, [piece.shape() for piece in pieces])
        elif len(members) > 1:  # a single member already holds the sum
            group = groups.group(members)
            handle = comm.all_reduce(buffer, "sum", label=label, group=group, async_op=True, ledger=ledger)
        pending.append((handle, pieces, views, members, buffer))
    for handle, pieces, views, members, buffer in pending:
        if handle is not None and demo:
            exchange.finish(handle, views)  # type: ignore[union-attr]
        elif handle is not None:
            handle.wait()
            _check_reduced(buffer, members, on_bad_payload)
        for piece, view in zip(pieces, views, strict=True):
            piece.scatter(view, sign)


def _check_reduced(buffer: torch.Tensor, members: tuple[int, ...], on_bad_payload: str) -> None:
    """Refuse (or zero, under ``"drop"``) an all-reduced bucket holding NaN/Inf: every member sees the same sum."""
    try:
        check_finite(buffer, what=f"the gradient bucket all-reduced over ranks {list(members)}")
    except PeerPayloadError as error:
        if on_bad_payload != "drop":
            raise
        report_dropped(error, "zero gradient for those coordinates this step")
        buffer.zero_()


def _check_demo(
    groups: RegionGroups, exchange: GradientExchange | None, label: str | None, ledger: ByteLedger | None
) -> None:
    if exchange is None:
        raise ValueError(
            "mode='demo' needs exchange=CompressedExchange(groups, kept_fraction=...) built once at setup: it holds"
            " each bucket's error-feedback buffer, which must persist across steps."
        )
    if exchange.groups is not groups:
        raise ValueError("exchange was built on other RegionGroups; pass the groups it was built with as layout.")
    if groups.helpers:
        raise ValueError("mode='demo' cannot be combined with helpers; use helper_fraction=0 or mode='mean'.")
    if (label is not None and label != INTER) or ledger is not None:
        raise ValueError(
            "mode='demo' sends through the FlexDeMo replicators, which record into the global ledger as 'inter';"
            " drop label=/ledger= and use comm.get_ledger().capture() to inspect the bytes."
        )


def _region_groups(
    layout: TierLayout | RegionGroups, helpers: Mapping[int, HelperConfig] | None, label: str | None
) -> RegionGroups:
    if isinstance(layout, RegionGroups):
        if helpers is not None and validate_helpers(layout.layout, helpers) != layout.helpers:
            raise ValueError("helpers differ from those the RegionGroups were built with; pass helpers=None.")
        return layout
    if not isinstance(layout, TierLayout):
        raise ValueError(f"layout must be a TierLayout or RegionGroups, got {type(layout).__name__}.")
    return RegionGroups(layout, helpers=helpers, label=INTER if label is None else label, verify=False)


def _plan(
    grads: Mapping[str, torch.Tensor],
    ffn_params: Sequence[FFNParameter],
    groups: RegionGroups,
    mode: str,
    tier_weights: TierWeights | None,
    step: int,
    rank_scale: Sequence[float] | None = None,
) -> dict[tuple[tuple[int, ...], torch.dtype], list[_Piece]]:
    """This rank's pieces per ``(member ranks, wire dtype)`` bucket, in an order every member shares."""
    layout, helpers, rank = groups.layout, groups.helpers, groups.rank
    for name, grad in grads.items():
        if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
            raise ValueError(
                f"grads[{name!r}] must be a floating-point tensor, got {getattr(grad, 'dtype', type(grad).__name__)};"
                " pass zeros for parameters without a gradient."
            )
    names = [param.name for param in ffn_params]
    if len(set(names)) != len(names):
        raise ValueError(f"ffn_params lists a parameter twice: {sorted({n for n in names if names.count(n) > 1})}.")
    missing = sorted(set(names) - set(grads))
    if missing:
        raise ValueError(f"grads lacks FFN parameters {missing}; pass zeros for parameters without a gradient.")
    weighted = tier_weights is not None or rank_scale is not None
    buckets: dict[tuple[tuple[int, ...], torch.dtype], list[_Piece]] = {}

    def add(members: tuple[int, ...], piece: _Piece) -> None:
        key = (members, wire_dtype(mode, piece.grad.dtype, weighted, len(members)))
        buckets.setdefault(key, []).append(piece)

    everyone = tuple(range(layout.world_size))
    other_weights = rank_weights(layout, tier_weights, rank_scale=rank_scale)
    for name in sorted(set(grads) - set(names)):
        add(everyone, _Piece(grads[name], None, 0, 0, other_weights[rank], sum(other_weights)))
    denominators: dict[int, torch.Tensor] = {}
    for param in sorted(ffn_params, key=lambda p: (p.layer, p.name)):
        grad, full = grads[param.name], layout.full_size_at(param.layer)
        if param.full_size != full:
            raise ValueError(
                f"{param.name}: full_size {param.full_size} != the layout's {full} for layer {param.layer}."
            )
        if not 0 <= param.axis < grad.dim():
            raise ValueError(
                f"{param.name}: axis {param.axis} is out of range for a gradient of shape {tuple(grad.shape)}."
            )
        width = layout.width(rank, param.layer)
        drawn = drawn_neurons(layout, rank, param.layer, helpers=helpers, step=step)
        size = grad.shape[param.axis]
        if size not in (width + drawn.numel(), full):
            raise ValueError(
                f"grads[{param.name!r}] has size {size} on axis {param.axis}; rank {rank} holds"
                f" {width + drawn.numel()} neurons of layer {param.layer} (width {width} + {drawn.numel()} helper"
                f" neurons): pass that local size or the full size {full}."
            )
        full_layout = size == full
        weights = rank_weights(layout, tier_weights, param.layer, rank_scale=rank_scale)
        for region in groups.regions(param.layer):
            if rank not in region.members:
                continue
            if region.helpers:  # per-neuron contributor weights differ inside the region
                if param.layer not in denominators:
                    denominators[param.layer] = contributor_weights(
                        layout,
                        param.layer,
                        tier_weights=tier_weights,
                        helpers=helpers,
                        step=step,
                        rank_scale=rank_scale,
                    )
                denominator: float | torch.Tensor = denominators[param.layer][region.start : region.stop]
            else:
                denominator = sum(weights[r] for r in region.ranks)
            piece = _Piece(grad, param.axis, region.start, region.stop, weights[rank], denominator)
            if rank in region.helpers:
                inside = (drawn >= region.start) & (drawn < region.stop)
                piece.region_positions = (drawn[inside] - region.start).to(grad.device)
                local = drawn[inside] if full_layout else width + torch.nonzero(inside).flatten()
                piece.grad_positions = local.to(grad.device)
                piece.write_whole_slab = full_layout  # a full-size helper keeps its whole tail in sync
            add(region.members, piece)
    return buckets
