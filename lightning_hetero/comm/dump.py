"""Write the process-global ledger to JSON at exit, so an outside harness can read what each rank counted.

Set ``LIGHTNING_HETERO_LEDGER_DIR=<dir>`` in a process's environment (the bandwidth testbed does) and importing
:mod:`lightning_hetero.comm` arranges for ``<dir>/ledger-rank<RANK>-pid<PID>.json`` to be written when the process
exits normally. :func:`load_ledger_dumps` reads them back. The file holds cumulative and per-step totals per label::

    {"rank": 0, "node_rank": 0, "local_rank": 0, "pid": 123,
     "totals": {"inter": {"sent": 1, "received": 1, "calls": 1}},
     "steps": {"0": {"inter": {"sent": 1, "received": 1, "calls": 1}}}}
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
from typing import Any

from lightning_hetero.comm.ledger import ByteLedger, get_ledger

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


def load_ledger_dumps(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every dump in ``directory``, ordered by (rank, pid)."""
    dumps = [json.loads(path.read_text()) for path in Path(directory).glob("ledger-rank*-pid*.json")]
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
