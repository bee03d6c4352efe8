"""The ``lightning-hetero`` message for ``settings.fault_tolerance`` given to a strategy that has no such mode.

FlexDeMo and MatFormer run their replicate dimension on torchft (``docs/spot.md``). jsonargparse would answer a
``fault_tolerance`` key under sparseflip, the subspace pipeline or another strategy with a generic "unrecognized
arguments" / "is not accepted"; this says which strategies have the mode and what to do instead.
"""

from __future__ import annotations

import re

__all__ = ["FAULT_TOLERANT_STRATEGIES", "fault_tolerance_message"]

FAULT_TOLERANT_STRATEGIES: tuple[str, ...] = ("FlexDeMoStrategy", "MatFormerStrategy")
"""The strategies whose settings take ``fault_tolerance`` (the spot worker mode, ``docs/spot.md``)."""

_UNSUPPORTED = re.compile(
    r"class_path '(?P<path>[\w.]+)'(?:(?!class_path ').)*?"
    r"(?:Option '(?:settings\.)?fault_tolerance[\w.]*' is not accepted"
    r"|does not accept option '(?:settings\.)?fault_tolerance\b"
    r"|unrecognized arguments: --(?:settings\.)?fault_tolerance\b)",
    re.S,
)


def fault_tolerance_message(message: str) -> str | None:
    """What to say when ``message`` is a parser error about ``fault_tolerance`` under a strategy without the mode."""
    match = _UNSUPPORTED.search(message)
    if match is None or match.group("path").rsplit(".", 1)[-1] in FAULT_TOLERANT_STRATEGIES:
        return None
    strategy = match.group("path").rsplit(".", 1)[-1]
    return (
        f"{strategy} does not run in the fault-tolerant (spot worker) mode: settings.fault_tolerance exists only for "
        "FlexDeMoStrategy (every replicator, DiLoCo included) and MatFormerStrategy (one rank per node, each node at "
        "its own tier), where nodes may die and rejoin while the others keep training. Use one of them with "
        f"settings.fault_tolerance, or drop fault_tolerance to run {strategy} with torchrun restarts from "
        "checkpoints. See docs/spot.md (and docs/reliability.md for restarts)."
    )
