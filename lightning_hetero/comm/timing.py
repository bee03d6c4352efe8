"""The clock of every communication timing metric, and the rule that keeps them below wall-clock time.

``comm/comm_seconds`` is the time during which at least one exchange was in flight: the length of the **union** of
the buckets' ``[launched, completed]`` spans, read on one monotonic wall clock (:func:`wall_clock`). Summing the spans
instead counts overlapping buckets several times and can exceed the step's duration many times over. A span whose
start is not a reading of :func:`wall_clock` (such as ``0.0``) would measure the time since the clock's origin;
:func:`union_seconds` refuses it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

__all__ = ["union_seconds", "wall_clock"]


def wall_clock() -> float:
    """Seconds on a monotonic wall clock (``time.perf_counter``: system-wide, counts sleep, never goes back)."""
    return time.perf_counter()


def union_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of the ``(start, end)`` spans: the time during which at least one of them was open.

    Raises:
        ValueError: A span that ends before it starts, or starts at or before 0 (not a :func:`wall_clock` reading).
    """
    ordered = sorted(spans)
    for start, end in ordered:
        if start <= 0.0 or end < start:
            raise ValueError(
                f"A communication span must run forward from a wall_clock() reading; got ({start}, {end}). "
                "Record the start with lightning_hetero.comm.timing.wall_clock() before the exchange begins."
            )
    total, open_start, open_end = 0.0, None, None
    for start, end in ordered:
        if open_end is None or start > open_end:
            if open_end is not None:
                total += open_end - open_start
            open_start, open_end = start, end
        else:
            open_end = max(open_end, end)
    if open_end is not None:
        total += open_end - open_start
    return total
