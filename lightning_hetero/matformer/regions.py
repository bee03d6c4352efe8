"""Regions: the nested pieces of an FFN hidden axis that the distinct widths of a tier layout cut it into.

A region is trained, and averaged, by exactly the ranks whose prefix covers it, plus the helper ranks whose tail
it lies in. :mod:`lightning_hetero.matformer.aggregate` turns regions into process groups and all-reduces.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lightning_hetero.matformer.helper_ranks import HelperConfig, helper_draw_size
from lightning_hetero.matformer.layout import TierLayout, is_int

__all__ = ["Region", "layer_regions", "regions"]


@dataclass(frozen=True)
class Region:
    """Neurons ``[start, stop)`` of an FFN hidden axis and the ranks whose gradients meet there."""

    start: int
    stop: int
    ranks: tuple[int, ...]
    """Ranks whose prefix covers the whole region: each trained every neuron of it."""
    helpers: tuple[int, ...] = ()
    """Helper ranks that join the region's exchange although it lies in their tail: each trained only the neurons
    it drew (see :func:`~lightning_hetero.matformer.helper_ranks.helper_neurons`) and sends zeros elsewhere."""

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
    if not widths or any(not is_int(w) or w < 1 for w in widths):
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
    active = [rank for rank in sorted(helpers or {}) if helper_draw_size(layout, helpers, rank, layer) > 0]
    return regions(layout.widths_at(layer), helper_ranks=active, full_size=full)
