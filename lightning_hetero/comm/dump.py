"""Write the process-global ledger to JSON at exit, so an outside harness can read what each rank counted.

Set ``LIGHTNING_HETERO_LEDGER_DIR=<dir>`` in a process's environment (the bandwidth testbed does) and importing
:mod:`lightning_hetero.comm` arranges for ``<dir>/ledger-rank<RANK>-pid<PID>.json`` to be written when the process
exits normally. :func:`load_ledger_dumps` reads them back. The file holds cumulative and per-step totals per label::

    {"rank": 0, "node_rank": 0, "local_rank": 0, "pid": 123,
     "totals": {"inter": {"sent": 1, "received": 1, "calls": 1}},
     "steps": {"0": {"inter": {"sent": 1, "received": 1, "calls": 1}}}}

Step ``"-1"`` (:data:`~lightning_hetero.comm.ledger.SETUP_STEP`) holds the traffic before the first step boundary
(e.g. a strategy's initial model broadcast), so step ``"0"`` holds only step 0's own traffic.
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
from typing import Any

from lightning_hetero.comm.ledger import ByteLedger, get_ledger
from lightning_hetero.comm.validation import PeerPayloadError, report_dropped, validate_on_bad_payload

LEDGER_DIR_ENV = "LIGHTNING_HETERO_LEDGER_DIR"
"""Environment variable naming the directory the ledger is dumped into at exit."""

_registered = False


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


def ledger_summary(ledger: ByteLedger) -> dict[str, Any]:
    """JSON-ready cumulative and per-step totals of ``ledger`` plus this process's rank identity."""
    return {
        "rank": _env_int("RANK"),
        "node_rank": _env_int("NODE_RANK") if _env_int("NODE_RANK") is not None else _env_int("GROUP_RANK"),
        "local_rank": _env_int("LOCAL_RANK"),
        "pid": os.getpid(),
        "totals": {label: ledger.totals(label).to_dict() for label in ledger.labels()},
        "steps": {
            str(step): {label: totals.to_dict() for label, totals in ledger.step_totals(step).items()}
            for step in ledger.steps()
        },
    }


def dump_ledger(directory: str | os.PathLike[str], ledger: ByteLedger | None = None) -> Path:
    """Write ``ledger`` (default: the process-global one) to ``directory``; returns the file written."""
    summary = ledger_summary(ledger or get_ledger())
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ledger-rank{summary['rank'] if summary['rank'] is not None else 'x'}-pid{os.getpid()}.json"
    path.write_text(json.dumps(summary, indent=1))
    return path


MAX_DUMP_BYTES = 256 << 20
"""A ledger dump larger than this is refused (a dump holds a few dozen bytes per step and label)."""
_DUMP_FIELDS: dict[str, tuple[type, ...]] = {
    "rank": (int, type(None)),
    "node_rank": (int, type(None)),
    "local_rank": (int, type(None)),
    "pid": (int,),
    "totals": (dict,),
    "steps": (dict,),
}


def read_ledger_dump(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One dump, checked: at most :data:`MAX_DUMP_BYTES`, JSON, the fields :func:`ledger_summary` writes.

    Raises:
        PeerPayloadError: the file is too large, not JSON (e.g. cut short by a killed rank) or of another shape.
    """
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_DUMP_BYTES:
        raise PeerPayloadError(f"ledger dump {path} is {size} bytes, more than the {MAX_DUMP_BYTES}-byte bound.")
    try:
        dump = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise PeerPayloadError(f"ledger dump {path} is not JSON ({error}); was its process killed?") from None
    bad = (
        [f for f, types in _DUMP_FIELDS.items() if not isinstance(dump.get(f), types) or isinstance(dump.get(f), bool)]
        if isinstance(dump, dict)
        else ["<not an object>"]
    )
    if bad:
        raise PeerPayloadError(
            f"ledger dump {path} has missing or mistyped field(s) {bad}; not a lightning-hetero dump."
        )
    return dump


def load_ledger_dumps(directory: str | os.PathLike[str], on_bad_payload: str = "raise") -> list[dict[str, Any]]:
    """Every dump in ``directory``, ordered by (rank, pid), each checked by :func:`read_ledger_dump`.

    Args:
        directory: Where the processes dumped their ledgers.
        on_bad_payload: ``"raise"`` on an unreadable dump, or ``"drop"`` it (logged as a warning).
    """
    validate_on_bad_payload("load_ledger_dumps", on_bad_payload)
    dumps = []
    for path in sorted(Path(directory).glob("ledger-rank*-pid*.json")):
        try:
            dumps.append(read_ledger_dump(path))
        except PeerPayloadError as error:
            if on_bad_payload != "drop":
                raise
            report_dropped(error, "ledger dump left out of the report")
    return sorted(dumps, key=lambda d: (d["rank"] if d["rank"] is not None else -1, d["pid"]))


def register_exit_dump() -> bool:
    """Dump the global ledger at exit if :data:`LEDGER_DIR_ENV` is set (idempotent); returns whether registered."""
    global _registered
    directory = os.environ.get(LEDGER_DIR_ENV)
    if not directory or _registered:
        return _registered
    atexit.register(dump_ledger, directory)
    _registered = True
    return True
