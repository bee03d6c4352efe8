"""Who trains which FFN neurons in tiered MatFormer training: pure, deterministic functions.

A rank at tier ``t`` trains the prefix ``[0, h >> t)`` of every FFN hidden axis, or one width per layer
(Mix'n'Match). The distinct widths cut the hidden axis into nested *regions*; a region is trained, and averaged, by
exactly the ranks whose prefix covers it. A helper rank (tier > 0) may also train a seeded, rotating subset of tail
neurons. Every rank computes all of this identically from the static configuration and the step, so none of it is
ever communicated. :mod:`lightning_hetero.matformer.aggregate` turns it into process groups and all-reduces.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_hetero.comm.ledger import wire_bytes
from lightning_hetero.matformer.types import FFNParameter, tier_width

__all__ = [
    "MODES",
    "HelperConfig",
    "Region",
    "TierLayout",
    "TierWeights",
    "bucket_numels",
    "bytes_per_step",
    "check_mode",
    "contributor_counts",
    "contributor_weights",
    "drawn_neurons",
    "helper_count",
    "helper_neurons",
    "helper_windows_for_full_coverage",
    "layer_regions",
    "rank_weights",
    "regions",
    "trained_neurons",
    "validate_helpers",
    "widths_for",
    "wire_dtype",
]

MODES = ("mean", "sign", "demo")
"""Aggregation modes: per-region mean, sign vote, or the mean through the DeMo replicator (compressed.py)."""

TierWeights = Mapping[int, float] | Sequence[float]
"""Weight of each tier's contribution: ``{tier: weight}`` or a sequence indexed by tier."""

_INT8_MAX_VOTERS = 127  # an int8 sum of n votes in {-1, 0, 1} cannot overflow while n <= 127


# ---------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class TierLayout:
    """The prefix width that every rank trains in every FFN layer. Build it with :func:`widths_for`."""

    widths: tuple[tuple[int, ...], ...]
    """``widths[rank][column]``: one column per layer, or a single column shared by all layers."""
    full_sizes: tuple[int, ...]
    """``full_sizes[column]``: the tier-0 FFN size ``h`` of each layer (one entry when shared by all layers)."""
    num_layers: int | None = None
    """Number of FFN layers, or None when every layer has the same widths and size (any layer index is accepted)."""

    def __post_init__(self) -> None:
        columns = 1 if self.num_layers is None else self.num_layers
        if not self.widths:
            raise ValueError("TierLayout needs at least one rank; got an empty widths table.")
        if len(self.full_sizes) != columns or any(len(row) != columns for row in self.widths):
            raise ValueError(
                f"TierLayout: every widths row and full_sizes must have {columns} column(s) (num_layers="
                f"{self.num_layers}); got full_sizes of {len(self.full_sizes)} and rows of "
                f"{sorted({len(row) for row in self.widths})}."
            )
        for rank, row in enumerate(self.widths):
            for column, (width, full) in enumerate(zip(row, self.full_sizes, strict=True)):
                if not 1 <= width <= full:
                    raise ValueError(f"rank {rank}, layer {column}: width {width} must be in [1, full_size={full}].")

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.widths)

    def columns(self) -> range:
        """The distinct layer columns: every layer, or just ``0`` when all layers share their widths."""
        return range(1 if self.num_layers is None else self.num_layers)

    def column(self, layer: int) -> int:
        """The column of ``layer`` in :attr:`widths` (0 for every layer when they all share one)."""
        if self.num_layers is None:
            return 0
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside this layout's {self.num_layers} layers.")
        return layer

    def widths_at(self, layer: int = 0) -> tuple[int, ...]:
        """Every rank's width in ``layer``."""
        column = self.column(layer)
        return tuple(row[column] for row in self.widths)

    def width(self, rank: int, layer: int = 0) -> int:
        """The prefix width ``rank`` trains in ``layer``."""
        return self.widths[rank][self.column(layer)]

    def full_size_at(self, layer: int = 0) -> int:
        """The tier-0 FFN size of ``layer``."""
        return self.full_sizes[self.column(layer)]

    def tier(self, rank: int, layer: int = 0) -> int | None:
        """``t`` with ``width == full_size / 2**t``, or None when the width is not such a power-of-two fraction."""
        full, width = self.full_size_at(layer), self.width(rank, layer)
        ratio, remainder = divmod(full, width)
        return ratio.bit_length() - 1 if remainder == 0 and ratio & (ratio - 1) == 0 else None


def widths_for(
    tiers_or_widths: Sequence[int | Sequence[int]],
    full_size: int | Sequence[int],
    *,
    num_layers: int | None = None,
    unit: Literal["tier", "width"] = "tier",
) -> TierLayout:
    """The :class:`TierLayout` of a run: which prefix width every rank trains in every layer.

    Args:
        tiers_or_widths: One entry per rank: a tier (``unit="tier"``) or a width (``unit="width"``) for all layers,
            or a sequence with one value per layer (Mix'n'Match).
        full_size: The tier-0 FFN size ``h``, or one size per layer.
        num_layers: Number of FFN layers; inferred from per-layer entries. Leave it None when every layer has the
            same widths: the layout then accepts any layer index.
        unit: Whether the entries are tiers (width ``h >> t``) or widths.

    Returns:
        The layout.

    Raises:
        ValueError: Unknown unit, an empty rank list, per-layer lengths that disagree, a tier that does not divide
            ``h``, or a width outside ``[1, h]``.
    """
    if unit not in ("tier", "width"):
        raise ValueError(f"unit must be 'tier' or 'width', got {unit!r}.")
    if isinstance(tiers_or_widths, (int, str)) or not len(tiers_or_widths):
        raise ValueError(
            f"tiers_or_widths must be a non-empty sequence with one entry per rank, got {tiers_or_widths!r}."
        )
    for rank, entry in enumerate(tiers_or_widths):
        if not (_is_int(entry) or isinstance(entry, Sequence)):
            raise ValueError(f"tiers_or_widths[{rank}] must be an int or one int per layer, got {entry!r}.")
    lengths = {len(entry) for entry in tiers_or_widths if not _is_int(entry)}
    if not _is_int(full_size):
        lengths.add(len(full_size))
    if num_layers is not None:
        lengths.add(num_layers)
    if len(lengths) > 1:
        raise ValueError(
            f"per-layer lengths disagree: {sorted(lengths)} (per-rank lists, full_size and num_layers must all give"
            " the same number of layers)."
        )
    layers = lengths.pop() if lengths else None
    if layers is not None and layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {layers}.")
    columns = 1 if layers is None else layers
    full_sizes = tuple([_as_int(full_size, "full_size")] * columns if _is_int(full_size) else map(int, full_size))
    rows = []
    for rank, entry in enumerate(tiers_or_widths):
        values = [_as_int(entry, f"tiers_or_widths[{rank}]")] * columns if _is_int(entry) else list(entry)
        row = []
        for column, (value, full) in enumerate(zip(values, full_sizes, strict=True)):
            value = _as_int(value, f"tiers_or_widths[{rank}][{column}]")
            if unit == "tier":
                try:
                    value = tier_width(full, value)
                except ValueError as error:
                    raise ValueError(f"rank {rank}, layer {column}: {error}") from None
            row.append(value)
        rows.append(tuple(row))
    return TierLayout(tuple(rows), full_sizes, layers)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(value: object, what: str) -> int:
    if not _is_int(value):
        raise ValueError(f"{what} must be an int, got {value!r}.")
    return int(value)


# ---------------------------------------------------------------------------------------------------- regions
@dataclass(frozen=True)
class Region:
    """Neurons ``[start, stop)`` of an FFN hidden axis and the ranks whose gradients meet there."""

    start: int
    stop: int
    ranks: tuple[int, ...]
    """Ranks whose prefix covers the whole region: each trained every neuron of it."""
    helpers: tuple[int, ...] = ()
    """Helper ranks that join the region's exchange although it lies in their tail: each trained only the neurons
    it drew (see :func:`helper_neurons`) and sends zeros elsewhere."""

    @property
    def size(self) -> int:
        """Number of neurons."""
        return self.stop - self.start

    @property
    def members(self) -> tuple[int, ...]:
        """Every rank that takes part in the region's all-reduce, sorted."""
        return tuple(sorted(self.ranks + self.helpers))


def regions(widths: Sequence[int], *, helper_ranks: Iterable[int] = (), full_size: int | None = None) -> list[Region]:
    """The nested partition of an FFN hidden axis by the distinct widths present, innermost region first.

    With distinct widths ``u_0 < u_1 < ...`` the regions are ``[0, u_0), [u_0, u_1), ...``; region ``[a, b)``
    belongs to the ranks with width ``>= b``. Helpers join every region beyond their own prefix, and, when no rank
    has full width, an extra region ``[max(widths), full_size)`` that only helpers can train.

    Args:
        widths: Each rank's width in this layer.
        helper_ranks: Ranks that also train rotating tail neurons in this layer.
        full_size: The tier-0 size ``h``; required with helpers.

    Returns:
        The regions, by ascending ``start``.
    """
    if not widths or any(not _is_int(w) or w < 1 for w in widths):
        raise ValueError(f"widths must be a non-empty sequence of positive ints (one per rank), got {list(widths)}.")
    helper_ranks = tuple(sorted(set(helper_ranks)))
    boundaries = sorted(set(widths))
    if helper_ranks:
        if full_size is None or full_size < boundaries[-1]:
            raise ValueError(f"regions with helpers need full_size >= max(widths)={boundaries[-1]}, got {full_size}.")
        for rank in helper_ranks:
            if not 0 <= rank < len(widths) or widths[rank] >= full_size:
                raise ValueError(f"helper rank {rank} must be a rank with width < full_size={full_size}.")
        if boundaries[-1] < full_size:
            boundaries.append(full_size)
    out, start = [], 0
    for stop in boundaries:
        holders = tuple(rank for rank, width in enumerate(widths) if width >= stop)
        out.append(Region(start, stop, holders, tuple(rank for rank in helper_ranks if widths[rank] <= start)))
        start = stop
    return out


def layer_regions(
    layout: TierLayout, layer: int = 0, helpers: Mapping[int, HelperConfig] | None = None
) -> list[Region]:
    """:func:`regions` of one layer of ``layout``, with the helpers that are active there."""
    full = layout.full_size_at(layer)
    active = [rank for rank in sorted(helpers or {}) if _draw_size(layout, helpers, rank, layer) > 0]
    return regions(layout.widths_at(layer), helper_ranks=active, full_size=full)


# ---------------------------------------------------------------------------------------------------- helpers
@dataclass(frozen=True)
class HelperConfig:
    """A rank that, besides its prefix, trains a rotating subset of tail neurons (helper fraction)."""

    fraction: float
    """Subset size relative to the rank's prefix width: ``floor(width * fraction)`` tail neurons per layer."""
    seed: int = 0
    """Seed of the draw; every rank must use the same value for this helper (it is part of the static config)."""
    redraw_every: int = 16
    """Optimizer steps between re-draws (the subset is fixed in between so that optimizer state can build up)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, (int, float)) and math.isfinite(self.fraction) and self.fraction >= 0):
            raise ValueError(f"HelperConfig.fraction must be a finite number >= 0, got {self.fraction!r}.")
        if not _is_int(self.seed):
            raise ValueError(f"HelperConfig.seed must be an int, got {self.seed!r}.")
        if not _is_int(self.redraw_every) or self.redraw_every < 1:
            raise ValueError(f"HelperConfig.redraw_every must be an int >= 1, got {self.redraw_every!r}.")


def helper_count(prefix_width: int, fraction: float) -> int:
    """``floor(prefix_width * fraction)``, rounded to 9 decimals first so that 768 * (1/3) gives 256, not 255."""
    return math.floor(round(prefix_width * fraction, 9))


def helper_neurons(
    prefix_width: int, full_size: int, fraction: float, seed: int, step: int, redraw_every: int, *, layer: int = 0
) -> torch.Tensor:
    """The tail neurons a helper trains at ``step``: ``floor(prefix_width * fraction)`` indices in ``[prefix, full)``.

    The tail is shuffled by a seeded permutation and walked in blocks: draw window ``k = step // redraw_every``
    takes the ``k``-th block of ``count`` consecutive entries (wrapping around), so every tail neuron is drawn
    within :func:`helper_windows_for_full_coverage` windows; after that a new permutation is used. The permutation
    is a pure integer hash of ``(seed, epoch, layer)``, identical on every rank, platform and torch version.

    Returns:
        A sorted int64 tensor of distinct neuron indices (empty when the count is 0).

    Raises:
        ValueError: Bad sizes, a negative step or fraction, or more helper neurons than the tail holds.
    """
    if not (_is_int(prefix_width) and _is_int(full_size) and 1 <= prefix_width <= full_size):
        raise ValueError(f"need ints 1 <= prefix_width <= full_size, got {prefix_width} and {full_size}.")
    if not (_is_int(step) and step >= 0 and _is_int(redraw_every) and redraw_every >= 1):
        raise ValueError(f"need an int step >= 0 and redraw_every >= 1, got {step!r} and {redraw_every!r}.")
    HelperConfig(fraction, seed, redraw_every)  # validates fraction and seed
    count, tail = helper_count(prefix_width, fraction), full_size - prefix_width
    if count > tail:
        raise ValueError(
            f"helper fraction {fraction} of width {prefix_width} asks for {count} tail neurons but only {tail} exist"
            f" (full_size {full_size}); use fraction <= {tail / prefix_width:g}."
        )
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    epoch, block = divmod(step // redraw_every, math.ceil(tail / count))
    permutation = _seeded_permutation(tail, f"{seed}:{epoch}:{layer}")
    positions = (torch.arange(count, dtype=torch.int64) + block * count) % tail
    return torch.sort(permutation[positions] + prefix_width).values


def helper_windows_for_full_coverage(prefix_width: int, full_size: int, fraction: float) -> int:
    """Draw windows after which every tail neuron has been drawn at least once: ``ceil(tail / count)``."""
    count = helper_count(prefix_width, fraction)
    if count < 1:
        raise ValueError(f"fraction {fraction} of width {prefix_width} draws no helper neurons.")
    return math.ceil((full_size - prefix_width) / count)


def validate_helpers(layout: TierLayout, helpers: Mapping[int, HelperConfig] | None) -> dict[int, HelperConfig]:
    """Check helper configs against ``layout``; returns the active ones (fraction > 0), keyed by rank."""
    active = {}
    for rank, config in sorted((helpers or {}).items()):
        if not _is_int(rank) or not 0 <= rank < layout.world_size:
            raise ValueError(f"helpers: rank {rank!r} is not in [0, {layout.world_size}).")
        if not isinstance(config, HelperConfig):
            raise ValueError(f"helpers[{rank}] must be a HelperConfig, got {type(config).__name__}.")
        for layer in layout.columns():
            width, full = layout.widths[rank][layer], layout.full_sizes[layer]
            if width < full and helper_count(width, config.fraction) > full - width:
                raise ValueError(
                    f"helpers[{rank}].fraction={config.fraction} draws {helper_count(width, config.fraction)} tail"
                    f" neurons in layer {layer} but its tail has {full - width};"
                    f" use fraction <= {(full - width) / width:g}."
                )
        if config.fraction > 0:
            active[rank] = config
    return active


def _draw_size(layout: TierLayout, helpers: Mapping[int, HelperConfig] | None, rank: int, layer: int) -> int:
    config = (helpers or {}).get(rank)
    width, full = layout.width(rank, layer), layout.full_size_at(layer)
    return 0 if config is None or width == full else helper_count(width, config.fraction)


def drawn_neurons(
    layout: TierLayout, rank: int, layer: int = 0, *, helpers: Mapping[int, HelperConfig] | None = None, step: int = 0
) -> torch.Tensor:
    """The tail neurons ``rank`` draws as a helper in ``layer`` at ``step`` (sorted; empty if it is no helper)."""
    if _draw_size(layout, helpers, rank, layer) == 0:
        return torch.empty(0, dtype=torch.int64)
    config = helpers[rank]  # type: ignore[index]
    width, full = layout.width(rank, layer), layout.full_size_at(layer)
    return helper_neurons(width, full, config.fraction, config.seed, step, config.redraw_every, layer=layer)


def trained_neurons(
    layout: TierLayout, rank: int, layer: int = 0, *, helpers: Mapping[int, HelperConfig] | None = None, step: int = 0
) -> torch.Tensor:
    """Neurons ``rank`` trains in ``layer`` at ``step``, in local order: its prefix, then its helper neurons."""
    prefix = torch.arange(layout.width(rank, layer), dtype=torch.int64)
    return torch.cat([prefix, drawn_neurons(layout, rank, layer, helpers=helpers, step=step)])


def _seeded_permutation(size: int, key: str) -> torch.Tensor:
    """A permutation of ``range(size)``: sort by a bijective 32-bit hash of ``index ^ sha256(key)`` (no ties)."""
    base = int.from_bytes(hashlib.sha256(f"lightning_hetero.matformer.helpers:{key}".encode()).digest()[:4], "little")
    return torch.argsort(_mix32(torch.arange(size, dtype=torch.int64) ^ base), stable=True)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The "lowbias32" integer hash on int64 tensors holding uint32 values; a bijection of ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` in 16-bit halves, so no int64 product ever overflows."""
    high = (((x >> 16) * constant) & 0xFFFF) << 16
    return (high + (x & 0xFFFF) * constant) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------------- weights
def rank_weights(layout: TierLayout, tier_weights: TierWeights | None, layer: int | None = None) -> tuple[float, ...]:
    """Weight of every rank's contribution in FFN ``layer``, or for non-FFN parameters when ``layer`` is None.

    A rank's tier is ``layout.tier(rank, layer)``; for non-FFN parameters it is the rank's lowest tier over all
    layers (its widest FFN). Without ``tier_weights`` every weight is 1.

    Raises:
        ValueError: A width that is no power-of-two fraction of ``h``, a tier missing from ``tier_weights``, or a
            weight that is not finite and > 0.
    """
    if tier_weights is None:
        return (1.0,) * layout.world_size
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
        out.append(weight)
    return tuple(out)


def contributor_weights(
    layout: TierLayout,
    layer: int = 0,
    *,
    tier_weights: TierWeights | None = None,
    helpers: Mapping[int, HelperConfig] | None = None,
    step: int = 0,
) -> torch.Tensor:
    """Per neuron of ``layer``, the summed weight of the ranks that trained it at ``step`` (float64, length ``h``).

    This is the denominator of the weighted per-neuron mean; without ``tier_weights`` it is the contributor count.
    """
    weights = rank_weights(layout, tier_weights, layer)
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
    *,
    mode: str = "mean",
    dtypes: torch.dtype | Mapping[str, torch.dtype] = torch.float32,
    tier_weights: TierWeights | None = None,
    helpers: Mapping[int, HelperConfig] | None = None,
) -> list[int]:
    """Bytes each rank sends (and, equally, receives) per step under the ledger's all-reduce rule.

    Per bucket of ``n`` members and ``S`` bytes, each member moves ``2 * (n - 1) * S // n`` each way
    (:func:`~lightning_hetero.comm.ledger.wire_bytes`); a rank's total is the sum over the buckets it belongs to.
    Arguments as for :func:`bucket_numels`. Returns one count per rank. For ``mode="demo"`` use
    :func:`~lightning_hetero.matformer.compressed.demo_bytes_per_step`.
    """
    if mode == "demo":
        raise ValueError("bytes_per_step counts all-reduces; for mode='demo' use compressed.demo_bytes_per_step.")
    totals = [0] * layout.world_size
    buckets = bucket_numels(
        layout, ffn_params, param_shapes, mode=mode, dtypes=dtypes, tier_weights=tier_weights, helpers=helpers
    )
    for (members, dtype), numel in buckets.items():
        sent, _ = wire_bytes("all_reduce", numel * torch.empty(0, dtype=dtype).element_size(), len(members))
        for rank in members:
            totals[rank] += sent
    return totals
