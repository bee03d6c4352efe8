"""Which tier each rank trains, chosen from measurements: the pure rule behind MatFormer's ``tiers: auto``.

Every rank measures, on one probe batch, its training step time and its peak memory at each candidate tier
(:class:`TierMeasurement`); :func:`choose_tiers` turns every rank's measurements into one tier entry per rank. It is
deterministic (the same measurements give the same choice, on every rank) and touches no device, so it is unit-tested
on fixed numbers.

The rule:

- the **reference** step is the fastest tier-0 step among the ranks whose tier-0 peak fits their memory budget (rank
  0 always trains tier 0: it holds the full model that is checkpointed and exported);
- a rank's **memory budget** is ``limit * (1 - memory_headroom)`` (no limit: any peak fits);
- each rank gets the **widest** candidate tier (smallest number) whose measured peak fits its budget and whose step
  is at most ``max_slowdown`` times the reference; a tier that was not probed (predicted over the limit) never fits;
- with ``num_layers`` (per-FFN mixing), a rank whose widest fitting tier is ``t > 0`` while tier ``t - 1`` was
  measured but misses the budget gets the first ``k`` FFNs at ``t - 1`` and the rest at ``t``, ``k`` the largest
  count whose *interpolated* step and peak still fit (both linear in the fraction ``k / num_layers`` between the two
  measured tiers; an estimate, not a measurement);
- a rank with no fitting tier (rank 0 included, whose only tier is 0) raises a ``ValueError`` naming the rank, its
  limit and budget, the reference, and each tier's step and peak, with the fixes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TierChoice", "TierMeasurement", "TierProbe", "choose_tiers", "format_bytes"]


@dataclass(frozen=True)
class TierProbe:
    """One candidate tier as one rank measured it.

    Attributes:
        step_seconds: Median wall time of one training step (forward, backward, optimizer step) at this tier; None
            when the tier was not probed.
        peak_bytes: Peak memory that training at this tier needs on this rank; None when the tier was not probed
            (its predicted peak exceeded the limit).
    """

    step_seconds: float | None
    peak_bytes: int | None


@dataclass(frozen=True)
class TierMeasurement:
    """What one rank measured at fit start.

    Attributes:
        rank: The global rank.
        memory_limit_bytes: The memory this rank may use (measured or given); None: no limit.
        tiers: Candidate tier -> its probe.
    """

    rank: int
    memory_limit_bytes: int | None
    tiers: Mapping[int, TierProbe] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready document (tiers keyed by their decimal string), read back by :meth:`from_json`."""
        return {
            "rank": self.rank,
            "memory_limit_bytes": self.memory_limit_bytes,
            "tiers": {
                str(tier): {"step_seconds": probe.step_seconds, "peak_bytes": probe.peak_bytes}
                for tier, probe in sorted(self.tiers.items())
            },
        }

    @classmethod
    def from_json(cls, document: Any, sender: int) -> TierMeasurement:
        """Rebuild a measurement from a peer's JSON document, checking every field.

        Args:
            document: The parsed JSON (from :meth:`to_json` on rank ``sender``).
            sender: The rank that sent it (named in errors; must equal the document's ``rank``).

        Raises:
            ValueError: A field is missing or of the wrong type, a number is negative or not finite, or the rank
                does not match the sender.
        """
        where = f"rank {sender}'s tier measurement"
        if not isinstance(document, Mapping) or set(document) != {"rank", "memory_limit_bytes", "tiers"}:
            raise ValueError(f"{where} is not a document with rank, memory_limit_bytes and tiers: {document!r}")
        rank = document["rank"]
        if rank != sender or isinstance(rank, bool):
            raise ValueError(f"{where} names rank {rank!r}")
        limit = _optional_count(document["memory_limit_bytes"], f"{where}: memory_limit_bytes")
        raw = document["tiers"]
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: tiers must be an object, got {raw!r}")
        tiers: dict[int, TierProbe] = {}
        for key, entry in raw.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise ValueError(f"{where}: tier key {key!r} is not a tier number")
            if not isinstance(entry, Mapping) or set(entry) != {"step_seconds", "peak_bytes"}:
                raise ValueError(f"{where}: tier {key} must hold step_seconds and peak_bytes, got {entry!r}")
            seconds = entry["step_seconds"]
            if seconds is not None and not (
                isinstance(seconds, (int, float))
                and not isinstance(seconds, bool)
                and math.isfinite(seconds)
                and seconds >= 0
            ):
                raise ValueError(f"{where}: tier {key} step_seconds={seconds!r} is not a finite number >= 0")
            peak = _optional_count(entry["peak_bytes"], f"{where}: tier {key} peak_bytes")
            tiers[int(key)] = TierProbe(None if seconds is None else float(seconds), peak)
        return cls(rank, limit, tiers)


def _optional_count(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}={value!r} is not an int >= 0 or null")
    return value


@dataclass(frozen=True)
class TierChoice:
    """The outcome of :func:`choose_tiers`.

    Attributes:
        per_rank: One entry per rank, in rank order: a tier, or (per-FFN mixing) one tier per FFN.
        reference_seconds: The reference step (fastest fitting tier-0 step).
        lines: One log line per rank: its entry, its step against the reference, its peak against its limit.
    """

    per_rank: list[int | list[int]]
    reference_seconds: float
    lines: list[str]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready document (to check that every rank chose the same)."""
        return {"per_rank": self.per_rank, "reference_seconds": self.reference_seconds}


def format_bytes(value: int | float | None) -> str:
    """``value`` in GiB (MiB below one GiB, bytes below one MiB), ``"none"`` for None."""
    if value is None:
        return "none"
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    if value >= 2**20:
        return f"{value / 2**20:.1f} MiB"
    return f"{int(value)} B"


def _budget(limit: int | None, headroom: float) -> float:
    return math.inf if limit is None else limit * (1.0 - headroom)


def _fits(probe: TierProbe | None, budget: float, deadline: float) -> bool:
    if probe is None or probe.step_seconds is None or probe.peak_bytes is None:
        return False
    return probe.peak_bytes <= budget and probe.step_seconds <= deadline


def choose_tiers(
    measurements: Sequence[TierMeasurement],
    *,
    max_slowdown: float = 1.1,
    memory_headroom: float = 0.1,
    num_layers: int | None = None,
) -> TierChoice:
    """One tier entry per rank from every rank's measurements (see the module docstring for the rule).

    Args:
        measurements: One per rank, in rank order (``measurements[r].rank == r``).
        max_slowdown: A rank's step may take at most this many times the reference step (>= 1).
        memory_headroom: Fraction of each rank's limit kept free (in ``[0, 1)``).
        num_layers: The number of FFNs, to allow per-FFN mixing of two adjacent tiers; None: uniform tiers only.

    Returns:
        The choice, with one log line per rank.

    Raises:
        ValueError: Bad arguments, or a rank (rank 0 at tier 0 included) that no candidate tier fits; the message
            names the rank, its limit, budget and measurements, the reference, and the fixes.
    """
    if not measurements:
        raise ValueError("choose_tiers: no measurements; every rank must send one.")
    for index, measurement in enumerate(measurements):
        if measurement.rank != index:
            raise ValueError(f"choose_tiers: measurement {index} is rank {measurement.rank}; pass them in rank order.")
    if not (isinstance(max_slowdown, (int, float)) and math.isfinite(max_slowdown) and max_slowdown >= 1):
        raise ValueError(f"choose_tiers: max_slowdown={max_slowdown!r} must be a finite number >= 1.")
    if not (isinstance(memory_headroom, (int, float)) and 0 <= memory_headroom < 1):
        raise ValueError(f"choose_tiers: memory_headroom={memory_headroom!r} must be in [0, 1).")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        raise ValueError(f"choose_tiers: num_layers={num_layers!r} must be an int >= 1 or None.")
    reference = _reference(measurements, memory_headroom)
    deadline = max_slowdown * reference
    per_rank: list[int | list[int]] = []
    lines: list[str] = []
    for measurement in measurements:
        budget = _budget(measurement.memory_limit_bytes, memory_headroom)
        candidates = [0] if measurement.rank == 0 else sorted(measurement.tiers)
        fitting = [tier for tier in candidates if _fits(measurement.tiers.get(tier), budget, deadline)]
        if not fitting:
            raise ValueError(_impossible(measurement, budget, reference, max_slowdown, memory_headroom))
        tier = fitting[0]
        entry: int | list[int] = tier
        seconds, peak = measurement.tiers[tier].step_seconds, measurement.tiers[tier].peak_bytes
        if num_layers is not None and tier > 0:
            mixed = _mix(measurement.tiers.get(tier - 1), measurement.tiers[tier], budget, deadline, num_layers)
            if mixed is not None:
                wider, seconds, peak = mixed
                entry = [tier - 1] * wider + [tier] * (num_layers - wider)
        per_rank.append(entry)
        assert seconds is not None
        what = f"tier {entry}" if isinstance(entry, int) else f"tiers {entry} (estimated)"
        lines.append(
            f"rank {measurement.rank}: {what}; step {seconds:.4f} s = {seconds / reference:.2f}x the reference "
            f"{reference:.4f} s (at most {max_slowdown}x); peak {format_bytes(peak)} of limit "
            f"{format_bytes(measurement.memory_limit_bytes)} (budget {format_bytes(_none_if_inf(budget))})"
        )
    return TierChoice(per_rank, reference, lines)


def _none_if_inf(value: float) -> float | None:
    return None if math.isinf(value) else value


def _reference(measurements: Sequence[TierMeasurement], headroom: float) -> float:
    """The fastest tier-0 step among the ranks whose tier-0 peak fits their budget."""
    steps = []
    for measurement in measurements:
        probe = measurement.tiers.get(0)
        budget = _budget(measurement.memory_limit_bytes, headroom)
        if probe is not None and _fits(probe, budget, math.inf):
            steps.append(probe.step_seconds)
    if not steps:
        rank0 = measurements[0]
        raise ValueError(
            "tiers auto: no rank fits tier 0 (the full model) in its memory budget, so there is no reference step; "
            "rank 0 must hold the full model. "
            + _describe(rank0, _budget(rank0.memory_limit_bytes, headroom))
            + f". Fix: give rank 0 more memory (or lower memory_headroom, now {headroom}), "
            "or put the node with the most memory first."
        )
    return float(min(s for s in steps if s is not None))


def _mix(
    wider: TierProbe | None, narrower: TierProbe, budget: float, deadline: float, num_layers: int
) -> tuple[int, float, float] | None:
    """The most FFNs at the wider tier whose interpolated step and peak fit: ``(count, seconds, peak)``, or None."""
    if wider is None or wider.step_seconds is None or wider.peak_bytes is None:
        return None
    assert narrower.step_seconds is not None and narrower.peak_bytes is not None
    best = None
    for count in range(1, num_layers):
        share = count / num_layers
        seconds = narrower.step_seconds + share * (wider.step_seconds - narrower.step_seconds)
        peak = narrower.peak_bytes + share * (wider.peak_bytes - narrower.peak_bytes)
        if seconds <= deadline and peak <= budget:
            best = (count, seconds, peak)
    return best


def _describe(measurement: TierMeasurement, budget: float) -> str:
    parts = []
    for tier, probe in sorted(measurement.tiers.items()):
        if probe.step_seconds is None or probe.peak_bytes is None:
            parts.append(f"tier {tier}: not probed (predicted over the limit)")
        else:
            parts.append(f"tier {tier}: step {probe.step_seconds:.4f} s, peak {format_bytes(probe.peak_bytes)}")
    return (
        f"rank {measurement.rank} (limit {format_bytes(measurement.memory_limit_bytes)}, budget "
        f"{format_bytes(_none_if_inf(budget))}): " + ("; ".join(parts) if parts else "no tiers measured")
    )


def _impossible(
    measurement: TierMeasurement, budget: float, reference: float, max_slowdown: float, headroom: float
) -> str:
    deadline = max_slowdown * reference
    if measurement.rank == 0:
        why = "rank 0 must train tier 0 (it holds the full model that is checkpointed and exported), and it misses "
        fix = "put the fastest node with the most memory first (rank 0), raise max_slowdown, or give rank 0 more memory"
    else:
        why = "no candidate tier fits both "
        fix = (
            f"raise max_slowdown (now {max_slowdown}), give rank {measurement.rank} more memory (or lower "
            f"memory_headroom, now {headroom}), add narrower candidate tiers, or leave that node out (or give it a "
            "smaller batch share)"
        )
    return (
        f"tiers auto: {why}the memory budget and the step limit of {deadline:.4f} s ({max_slowdown}x the reference "
        f"{reference:.4f} s, the fastest tier-0 step). {_describe(measurement, budget)}. Fix: {fix}; or pass "
        "explicit tiers."
    )
