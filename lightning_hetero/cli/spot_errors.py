"""The ``lightning-hetero`` message for ``settings.fault_tolerance`` given to a strategy that has no such mode.

Only FlexDeMo runs its replicate dimension on torchft (``docs/spot.md``). jsonargparse would answer a
``fault_tolerance`` key under MatFormer, sparseflip or another strategy with a generic "unrecognized arguments" /
"is not accepted"; this says which strategy has the mode and what to do instead.
"""

from __future__ import annotations

import re

__all__ = ["fault_tolerance_message"]

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
    if match is None or match.group("path").rsplit(".", 1)[-1] == "FlexDeMoStrategy":
        return None
    strategy = match.group("path").rsplit(".", 1)[-1]
    return (
        f"{strategy} does not run in the fault-tolerant (spot worker) mode: settings.fault_tolerance exists only for "
        "FlexDeMoStrategy (every replicator, DiLoCo included), where nodes may die and rejoin while the others keep "
        f"training. Use FlexDeMoStrategy with settings.fault_tolerance, or drop fault_tolerance to run {strategy} "
        "with torchrun restarts from checkpoints. See docs/spot.md (and docs/reliability.md for restarts)."
    )
