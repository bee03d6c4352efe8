"""Tier layouts: the prefix width every rank trains in every FFN layer of tiered MatFormer training.

A rank at tier ``t`` trains the prefix ``[0, h >> t)`` of every FFN hidden axis, or one width per layer (Mix'n'Match).
:func:`widths_for` builds the static :class:`TierLayout` that every rank computes identically; regions
(:mod:`~lightning_hetero.matformer.regions`) and helper draws (:mod:`~lightning_hetero.matformer.helper_ranks`) are
derived from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_hetero.matformer.types import tier_width

__all__ = ["TierLayout", "widths_for"]


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
        if not (is_int(entry) or isinstance(entry, Sequence)):
            raise ValueError(f"tiers_or_widths[{rank}] must be an int or one int per layer, got {entry!r}.")
    lengths = {len(entry) for entry in tiers_or_widths if not is_int(entry)}
    if not is_int(full_size):
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
    full_sizes = tuple([as_int(full_size, "full_size")] * columns if is_int(full_size) else map(int, full_size))
    rows = []
    for rank, entry in enumerate(tiers_or_widths):
        values = [as_int(entry, f"tiers_or_widths[{rank}]")] * columns if is_int(entry) else list(entry)
        row = []
        for column, (value, full) in enumerate(zip(values, full_sizes, strict=True)):
            value = as_int(value, f"tiers_or_widths[{rank}][{column}]")
            if unit == "tier":
                try:
                    value = tier_width(full, value)
                except ValueError as error:
                    raise ValueError(f"rank {rank}, layer {column}: {error}") from None
            row.append(value)
        rows.append(tuple(row))
    return TierLayout(tuple(rows), full_sizes, layers)


def is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` proper (``bool`` is not a layout size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value: object, what: str) -> int:
    """``value`` as an int, or a ``ValueError`` naming ``what``."""
    if not is_int(value):
        raise ValueError(f"{what} must be an int, got {value!r}.")
    return int(value)
