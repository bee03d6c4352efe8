"""The settings of tiers chosen from measurement (MatFormer ``tiers: auto``): :class:`AutoTierSettings`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_hetero.core.settings import check_int

__all__ = ["AutoTierSettings", "expand_per_rank"]

_OWNER = "AutoTierSettings"


@dataclass(frozen=True, kw_only=True)
class AutoTierSettings:
    """How ``tiers: auto`` measures and chooses (see :func:`~lightning_hetero.hetero.tier_choice.choose_tiers`).

    Attributes:
        candidates: The tiers a rank may get (distinct ints >= 0, tier 0 among them); each is probed on every rank,
            narrowest first, unless its predicted peak exceeds the rank's limit.
        max_slowdown: A rank's step may take at most this many times the fastest tier-0 step (>= 1).
        memory_headroom: Fraction of each rank's memory limit kept free, in ``[0, 1)``.
        probe_repeats: Timed probe steps per tier (the median counts), >= 1.
        probe_warmup: Untimed probe steps per tier before them, >= 0.
        memory_limit_bytes: The limit to choose against instead of the measured one (device memory on CUDA, the
            memory cgroup on CPU): one entry per global rank or per node, each an int >= 1 or None (measure that
            rank). None: every rank measures its own.
        mix_layers: Also allow one rank to train two adjacent tiers across its FFNs (the first ones wider), sized by
            interpolating between the two measured tiers; the entry is then per FFN, and ``TierEvaluation`` /
            ``TierExport`` need their own ``tiers``.
    """

    candidates: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    max_slowdown: float = 1.1
    memory_headroom: float = 0.1
    probe_repeats: int = 3
    probe_warmup: int = 1
    memory_limit_bytes: list[int | None] | None = None
    mix_layers: bool = False

    def __post_init__(self) -> None:
        candidates = self.candidates
        if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence) or not candidates:
            raise ValueError(f"{_OWNER}.candidates={candidates!r}: give a list of tiers, e.g. [0, 1, 2, 3].")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in candidates):
            raise ValueError(f"{_OWNER}.candidates={list(candidates)}: every tier must be an int >= 0.")
        if len(set(candidates)) != len(candidates) or 0 not in candidates:
            raise ValueError(
                f"{_OWNER}.candidates={list(candidates)}: give distinct tiers including 0 (rank 0 trains the full "
                "model), e.g. [0, 1, 2, 3]."
            )
        object.__setattr__(self, "candidates", sorted(candidates))
        slowdown = self.max_slowdown
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not math.isfinite(slowdown):
            raise ValueError(f"{_OWNER}.max_slowdown={slowdown!r}: use a finite number >= 1, e.g. 1.1.")
        if slowdown < 1:
            raise ValueError(f"{_OWNER}.max_slowdown={slowdown!r}: use a number >= 1 (1.1: within 10% of the fastest).")
        object.__setattr__(self, "max_slowdown", float(slowdown))
        headroom = self.memory_headroom
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
            raise ValueError(f"{_OWNER}.memory_headroom={headroom!r}: use a fraction in [0, 1), e.g. 0.1.")
        object.__setattr__(self, "memory_headroom", float(headroom))
        check_int(_OWNER, "probe_repeats", self.probe_repeats, minimum=1)
        check_int(_OWNER, "probe_warmup", self.probe_warmup, minimum=0)
        limits = self.memory_limit_bytes
        if limits is not None:
            if isinstance(limits, (str, bytes, int)) or not isinstance(limits, Sequence) or not limits:
                raise ValueError(
                    f"{_OWNER}.memory_limit_bytes={limits!r}: give a list with one entry per rank or per node (an "
                    "int >= 1, or null to measure that rank), or leave it out to measure every rank."
                )
            if any(v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1) for v in limits):
                raise ValueError(
                    f"{_OWNER}.memory_limit_bytes={list(limits)}: every entry must be an int >= 1 (bytes) or null."
                )
            object.__setattr__(self, "memory_limit_bytes", list(limits))
        if not isinstance(self.mix_layers, bool):
            raise ValueError(f"{_OWNER}.mix_layers={self.mix_layers!r}: use true or false.")


def expand_per_rank(owner: str, name: str, values: Sequence[Any], world_size: int, num_nodes: int) -> list[Any]:
    """One value per global rank: ``values`` given per rank, or per node (node ``k`` holds ranks ``[kP, (k+1)P)``).

    Raises:
        ValueError: The number of values fits neither the ranks nor the nodes; the message names ``name``.
    """
    if len(values) == world_size:
        return list(values)
    if num_nodes >= 1 and len(values) == num_nodes and world_size % num_nodes == 0:
        return [value for value in values for _ in range(world_size // num_nodes)]
    raise ValueError(
        f"{owner}: {name}={list(values)} has {len(values)} entries, but the run has {world_size} ranks "
        f"({num_nodes} node(s)). Give one entry per global rank ({world_size}) or one per node ({num_nodes})."
    )
