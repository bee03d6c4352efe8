"""Merge the veth byte counters of each node with the byte ledgers its ranks dumped, into one JSON report.

Wire bytes are what crossed the node's ``eth0`` during the run (after minus before); ledger bytes are what the
ranks counted through :mod:`lightning_hetero.comm` (see ``docs/communication.md``). ``wire_over_ledger`` divides
the first by the second (all labels summed), which is protocol overhead when every counted byte crosses nodes. The
schema is documented in ``docs/testbed.md``; bump :data:`REPORT_SCHEMA` when a key changes meaning.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_hetero.testbed.netns import InterfaceCounters

__all__ = ["REPORT_SCHEMA", "build_report", "node_ledger", "node_resources", "write_report"]

REPORT_SCHEMA = "lightning-hetero-testbed-report/1"
_FIELDS = ("sent", "received", "calls")


def _accumulate(into: dict[str, dict[str, int]], per_label: Mapping[str, Mapping[str, int]]) -> None:
    for label, totals in per_label.items():
        bucket = into.setdefault(label, dict.fromkeys(_FIELDS, 0))
        for key in _FIELDS:
            bucket[key] += int(totals.get(key, 0))


def _dump_node(dump: Mapping[str, Any], ranks_per_node: int) -> int | None:
    """The node a dump belongs to: its recorded node rank, else derived from its global rank."""
    if dump.get("node_rank") is not None:
        return int(dump["node_rank"])
    if dump.get("rank") is not None:
        return int(dump["rank"]) // ranks_per_node
    return None


def node_ledger(dumps: Sequence[Mapping[str, Any]], node: int, ranks_per_node: int) -> dict[str, Any]:
    """Sum the ledger dumps of one node's ranks.

    Args:
        dumps: Every dump of the run (``lightning_hetero.comm.load_ledger_dumps``).
        node: The node to sum.
        ranks_per_node: Used to place dumps that carry a rank but no node rank.

    Returns:
        ``{"ranks": [...], "totals": {label: {sent, received, calls}}, "total": {sent, received, calls},
        "steps": {step: {label: {sent, received, calls}}}}``; steps are string keys sorted numerically.
    """
    mine = [dump for dump in dumps if _dump_node(dump, ranks_per_node) == node]
    totals: dict[str, dict[str, int]] = {}
    steps: dict[str, dict[str, dict[str, int]]] = {}
    for dump in mine:
        _accumulate(totals, dump.get("totals", {}))
        for step, per_label in dump.get("steps", {}).items():
            _accumulate(steps.setdefault(str(step), {}), per_label)
    total = {key: sum(per_label[key] for per_label in totals.values()) for key in _FIELDS}
    return {
        "ranks": sorted(dump["rank"] for dump in mine if dump.get("rank") is not None),
        "totals": dict(sorted(totals.items())),
        "total": total,
        "steps": {step: dict(sorted(steps[step].items())) for step in sorted(steps, key=_step_order)},
    }


def _step_order(step: str) -> tuple[int, str]:
    return (int(step), "") if step.lstrip("-").isdigit() else (0, step)


def _ratio(wire: int, ledger: int) -> float | None:
    return wire / ledger if ledger > 0 else None


def node_resources(
    *,
    cpu_quota: float | None,
    memory_limit_bytes: int | None,
    cgroup_version: int | None = None,
    cgroup_name: str | None = None,
    usage: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One node's compute and memory entry of the report (``--node-cpu``/``--node-memory``).

    Args:
        cpu_quota: Cores of CPU time the node may use (None: unlimited).
        memory_limit_bytes: The node's memory limit (None: unlimited).
        cgroup_version: 1 or 2; None when the node had no cgroup.
        cgroup_name: The group's name (``lhtb-<id>-n<k>``).
        usage: What the group counted during the run (:class:`~lightning_hetero.testbed.cgroups.CgroupUsage`
            fields: ``cpu_seconds``, ``memory_peak_bytes``, ``oom_kills`` ...).

    Returns:
        ``{"cpu_quota", "memory_limit_bytes", "cgroup": None | {"version", "name", **usage}}``.
    """
    cgroup = None if cgroup_version is None else {"version": cgroup_version, "name": cgroup_name, **(usage or {})}
    return {"cpu_quota": cpu_quota, "memory_limit_bytes": memory_limit_bytes, "cgroup": cgroup}


def build_report(
    *,
    run_id: str,
    config: Mapping[str, Any],
    node_addresses: Sequence[str],
    counters_before: Sequence[InterfaceCounters],
    counters_after: Sequence[InterfaceCounters],
    ledger_dumps: Sequence[Mapping[str, Any]],
    processes: Sequence[Mapping[str, Any]],
    exit_code: int,
    timed_out: bool,
    elapsed_seconds: float,
    run_dir: str,
    ledger_dir: str,
    resources: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON report of one run (schema in ``docs/testbed.md``).

    ``resources`` holds each node's :func:`node_resources` entry; without it every node is reported unlimited.
    """
    ranks_per_node = int(config["ranks_per_node"])
    nodes = []
    for node, address in enumerate(node_addresses):
        wire = counters_after[node] - counters_before[node]
        ledger = node_ledger(ledger_dumps, node, ranks_per_node)
        tx_ratio = _ratio(wire.tx_bytes, ledger["total"]["sent"])
        rx_ratio = _ratio(wire.rx_bytes, ledger["total"]["received"])
        nodes.append(
            {
                "node": node,
                "address": address,
                "wire": wire.to_dict(),
                "ledger": ledger,
                "wire_over_ledger": (
                    None
                    if tx_ratio is None and rx_ratio is None
                    else {"tx_over_sent": tx_ratio, "rx_over_received": rx_ratio}
                ),
                **(
                    dict(resources[node])
                    if resources is not None
                    else node_resources(cpu_quota=None, memory_limit_bytes=None)
                ),
            }
        )
    return {
        "schema": REPORT_SCHEMA,
        "run_id": run_id,
        "config": dict(config),
        "exit_code": exit_code,
        "timed_out": timed_out,
        "elapsed_seconds": elapsed_seconds,
        "run_dir": run_dir,
        "ledger_dir": ledger_dir,
        "processes": [dict(process) for process in processes],
        "nodes": nodes,
        "ledger_dumps": [dict(dump) for dump in ledger_dumps],
    }


def write_report(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``report`` as indented JSON (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path
