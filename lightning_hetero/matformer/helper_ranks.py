"""Helper ranks: a rank below full width that also trains a seeded, rotating subset of its FFN tail neurons.

The draw is a pure function of the static configuration and the optimizer step (an integer hash, identical on every
rank, platform and torch version), so it is never communicated.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lightning_hetero.matformer.layout import TierLayout, is_int

__all__ = [
    "HelperConfig",
    "drawn_neurons",
    "helper_count",
    "helper_draw_size",
    "helper_neurons",
    "helper_windows_for_full_coverage",
    "trained_neurons",
    "validate_helpers",
]


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
        if not is_int(self.seed):
            raise ValueError(f"HelperConfig.seed must be an int, got {self.seed!r}.")
        if not is_int(self.redraw_every) or self.redraw_every < 1:
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
    if not (is_int(prefix_width) and is_int(full_size) and 1 <= prefix_width <= full_size):
        raise ValueError(f"need ints 1 <= prefix_width <= full_size, got {prefix_width} and {full_size}.")
    if not (is_int(step) and step >= 0 and is_int(redraw_every) and redraw_every >= 1):
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
        if not is_int(rank) or not 0 <= rank < layout.world_size:
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


def helper_draw_size(layout: TierLayout, helpers: Mapping[int, HelperConfig] | None, rank: int, layer: int) -> int:
    """How many tail neurons ``rank`` draws in ``layer`` (0 when it is no helper or already has full width)."""
    config = (helpers or {}).get(rank)
    width, full = layout.width(rank, layer), layout.full_size_at(layer)
    return 0 if config is None or width == full else helper_count(width, config.fraction)


def drawn_neurons(
    layout: TierLayout, rank: int, layer: int = 0, *, helpers: Mapping[int, HelperConfig] | None = None, step: int = 0
) -> torch.Tensor:
    """The tail neurons ``rank`` draws as a helper in ``layer`` at ``step`` (sorted; empty if it is no helper)."""
    if helper_draw_size(layout, helpers, rank, layer) == 0:
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
