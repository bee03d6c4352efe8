"""Pipeline schedules as plain lists of actions: which microbatch each stage runs forward or backward, in order.

A schedule is a list of :class:`Action` per stage (one stage per rank). The executor in
:mod:`lightning_hetero.subspace_pipeline.pipeline` walks the list: a forward receives the boundary coordinates from the
previous stage (blocking), runs the stage and sends its output on (non-blocking); a backward receives the output
gradient from the next stage (blocking), back-propagates and sends the input gradient back (non-blocking). Every
stage sends and receives the microbatches of each direction in increasing order, so messages on one link never
overtake each other and blocking receives cannot deadlock.

- ``"gpipe"``: all forwards, then all backwards. Simple; keeps all ``M`` microbatches' activations alive.
- ``"1f1b"``: stage ``s`` of ``P`` runs ``min(P - 1 - s, M)`` warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. Same bubble as GPipe, but at most ``P - s`` microbatches in flight,
  so activation memory no longer grows with ``M``.

Nothing here communicates or imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["SCHEDULES", "Action", "build_schedule", "check_schedule"]

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
"""Schedule names accepted by :func:`build_schedule` (one stage per rank)."""

_MULTI_STAGE_SCHEDULES = ("interleaved", "interleaved1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev")


@dataclass(frozen=True)
class Action:
    """One step of a schedule: run microbatch ``microbatch`` of this stage forward (``"F"``) or backward (``"B"``)."""

    kind: Literal["F", "B"]
    microbatch: int


def check_schedule(schedule: str, owner: str = "SubspacePipelineSettings") -> str:
    """Return the canonical (lowercase) schedule name, or raise a ValueError that lists the supported ones."""
    name = str(schedule).lower().replace("-", "").replace("_", "") if isinstance(schedule, str) else ""
    aliases = {"gpipe": "gpipe", "1f1b": "1f1b", "onefoneb": "1f1b"}
    if name in aliases:
        return aliases[name]
    if isinstance(schedule, str) and schedule.lower() in _MULTI_STAGE_SCHEDULES + ("interleaved_1f1b",):
        raise ValueError(
            f"{owner}.schedule={schedule!r}: interleaved schedules need several stages per rank, which this runtime "
            f"does not run (one stage per rank keeps every boundary on the wire and in the ledger). "
            f"Use one of {list(SCHEDULES)}."
        )
    raise ValueError(f"{owner}.schedule={schedule!r} is not a known schedule; use one of {list(SCHEDULES)}.")


def build_schedule(schedule: str, stage: int, num_stages: int, n_microbatches: int) -> list[Action]:
    """The ordered actions of ``stage`` (0-based) in a pipeline of ``num_stages`` stages over ``n_microbatches``.

    Args:
        schedule: ``"gpipe"`` or ``"1f1b"``.
        stage: This rank's stage index.
        num_stages: Number of stages ``P``.
        n_microbatches: Number of microbatches ``M`` per optimizer step.

    Returns:
        ``2 * M`` actions: every microbatch once forward and once backward, each forward before its backward, both
        kinds in increasing microbatch order.

    Raises:
        ValueError: Unknown schedule, or a stage index or count out of range.
    """
    name = check_schedule(schedule)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} is outside 0..{num_stages - 1}.")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches} must be >= 1.")
    forwards = [Action("F", m) for m in range(n_microbatches)]
    backwards = [Action("B", m) for m in range(n_microbatches)]
    if name == "gpipe":
        return forwards + backwards
    warmup = min(num_stages - 1 - stage, n_microbatches)
    actions = forwards[:warmup]
    for index in range(n_microbatches - warmup):
        actions += [forwards[warmup + index], backwards[index]]
    return actions + backwards[n_microbatches - warmup :]
