"""Planning and reporting of the spot recipe (recipes/spot/spot_recipe.py): the fault schedule, and what the workers'
logs say about it. No processes here: these functions read the ``replica_<node>.jsonl`` records that
``recipes/spot/spot_trainer_worker.py`` writes (one line per committed step, a ``final`` line at the end), so they are
tested on hand-made records (tests/unit/ft/test_spot_recipe.py).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Record = dict[str, Any]


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule.

    Attributes:
        kind: ``"kill"`` (SIGKILL the nodes, start them again after ``hold_s``), ``"stop"`` (SIGSTOP, SIGCONT after
            ``hold_s``) or ``"lighthouse"`` (SIGKILL the lighthouse, start it again on the same address after
            ``hold_s``).
        nodes: The victims (empty for ``"lighthouse"``).
        hold_s: Seconds the victims stay down, at least (a kill also waits for the survivors to commit).
    """

    kind: str
    nodes: tuple[int, ...] = ()
    hold_s: float = 0.0


def plan(
    nodes: int, min_replicas: int, *, freeze_s: float, outage_s: float, below_min_s: float, quorum_timeout_s: float
) -> list[Fault]:
    """The recipe's schedule: two single kills (nodes ``n-1`` then ``n-2``), a freeze of node ``n-2`` past the
    quorum timeout, a lighthouse restart, and ``nodes - min_replicas + 1`` nodes killed together for ``below_min_s``
    (the survivors are below ``min_replicas`` and wait) before they are started again.

    Raises:
        ValueError: naming the argument, when the schedule could not show what it is meant to show.
    """
    if nodes < 3:
        raise ValueError(f"nodes={nodes}: the schedule needs at least 3 nodes (kills with 2 survivors).")
    if not 2 <= min_replicas < nodes:
        raise ValueError(
            f"min_replicas={min_replicas}: use 2 ... nodes - 1 ({nodes - 1}) so a single kill leaves a "
            "quorum and the below-minimum period has a survivor."
        )
    if freeze_s <= quorum_timeout_s:
        raise ValueError(f"freeze_s={freeze_s}: the freeze must outlast quorum_timeout_s={quorum_timeout_s}.")
    if outage_s <= 0 or below_min_s <= 0:
        raise ValueError(f"outage_s={outage_s}, below_min_s={below_min_s}: both must be > 0 seconds.")
    down = tuple(range(nodes - 1, min_replicas - 2, -1))  # nodes - min_replicas + 1 victims: one survivor fewer
    return [
        Fault("kill", (nodes - 1,)),
        Fault("kill", (nodes - 2,)),
        Fault("stop", (nodes - 2,), freeze_s),
        Fault("lighthouse", (), outage_s),
        Fault("kill", down, below_min_s),
    ]


def read_records(out: Path, node: int) -> list[Record]:
    """Every complete JSON line a worker wrote (a line cut by a kill is skipped)."""
    path = out / f"replica_{node}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def steps(records: list[Record]) -> list[Record]:
    """The committed-step records (not the ``final`` one)."""
    return [r for r in records if not r.get("final")]


def longest_gap(records: dict[int, list[Record]], nodes: list[int], start: float, end: float) -> float:
    """Longest time between consecutive commits of any of ``nodes`` within ``[start, end]`` (the edges count)."""
    worst = 0.0
    for node in nodes:
        times = [start] + [r["time"] for r in steps(records[node]) if start < r["time"] < end] + [end]
        worst = max(worst, *(b - a for a, b in zip(times, times[1:], strict=False)))
    return worst


def position(record: Record) -> int:
    """The batch's position in the node's shard, counted over epochs."""
    return record["epoch"] * record["batches_per_epoch"] + record["batch_idx"]


def batch_checks(records: dict[int, list[Record]]) -> dict[str, Any]:
    """What the nodes trained on, from the batch hashes and positions of every committed step.

    - ``distinct_node_batches``: at every step committed by two nodes or more, their batches differ;
    - ``batches_trained_twice``: extra occurrences of a batch (by hash) anywhere in the run;
    - ``batches_skipped``: positions ``step - 1`` of a node's shard, for the steps it committed, that it never
      trained (a node follows the committed step: the batch of step ``s`` is position ``s - 1``);
    - ``off_position_batches``: commits whose batch is not at position ``step - 1`` (a batch held through a freeze).
    """
    by_step: dict[int, list[str]] = {}
    counts: Counter[str] = Counter()
    skipped = off = 0
    for node_records in records.values():
        committed = steps(node_records)
        trained = {position(r) for r in committed}
        skipped += len({r["step"] - 1 for r in committed} - trained)
        off += sum(position(r) != r["step"] - 1 for r in committed)
        for record in committed:
            by_step.setdefault(record["step"], []).append(record["batch_hash"])
            counts[record["batch_hash"]] += 1
    shared = [hashes for hashes in by_step.values() if len(hashes) > 1]
    return {
        "distinct_node_batches": bool(shared) and all(len(set(h)) == len(h) for h in shared),
        "steps_with_two_or_more_nodes": len(shared),
        "batches_trained_twice": sum(c - 1 for c in counts.values()),
        "batches_skipped": skipped,
        "off_position_batches": off,
    }


def dropped_batches(records: dict[int, list[Record]]) -> int:
    """Batches the nodes dropped after an in-place heal (drawn for a step committed without them): each process's
    last count (``abandoned``; a restarted node counts from 0 again), summed."""
    last: dict[tuple[int, int], int] = {}
    for node, node_records in records.items():
        for record in steps(node_records):
            last[(node, record["pid"])] = int(record.get("abandoned", 0))
    return sum(last.values())


def steps_lost(records: dict[int, list[Record]]) -> int:
    """Committed steps (1 ... the last) missing from the union of every node's records."""
    committed = {r["step"] for node_records in records.values() for r in steps(node_records)}
    return len(set(range(1, max(committed) + 1)) - committed) if committed else 0


def survivor_restarts(records: dict[int, list[Record]], starts: dict[int, int]) -> int:
    """Processes beyond the ones the recipe started: a node whose pid changed without the recipe restarting it."""
    return sum(max(0, len({r["pid"] for r in steps(records[n])}) - starts[n]) for n in records)


def link_ratio(records: dict[int, list[Record]], nodes: int) -> dict[str, Any]:
    """R on this link: median exchange seconds over median other seconds of a step (full quorum, first try)."""
    full = [r for rs in records.values() for r in steps(rs) if r["participants"] == nodes and r["retries"] == 0]
    full = [r for r in full if r.get("comm_s") is not None and r["step_s"] > r["comm_s"]]
    if not full:
        return {"R": None, "comm_s": None, "compute_s": None}
    comm = statistics.median(r["comm_s"] for r in full)
    compute = statistics.median(r["step_s"] - r["comm_s"] for r in full)
    return {"R": round(comm / compute, 4), "comm_s": round(comm, 5), "compute_s": round(compute, 5)}


def rejoin(records: dict[int, list[Record]], node: int, after: float) -> dict[str, Any] | None:
    """The node's first commit after ``after`` and whether its weights equal every peer's at that step (None while
    it or a peer has not committed that step yet)."""
    first = next((r for r in steps(records[node]) if r["time"] > after), None)
    if first is None:
        return None
    peers = {}
    for peer in records:
        if peer != node:
            match = next((r for r in steps(records[peer]) if r["step"] == first["step"]), None)
            if match is not None:
                peers[peer] = match["digest"]
    if len(peers) < first["participants"] - 1:
        return None
    return {
        "node": node,
        "rejoined_at_step": first["step"],
        "participants": first["participants"],
        "global_step": first["global_step"],
        "bit_identical": bool(peers) and all(d == first["digest"] for d in peers.values()),
    }


def pct(value: float, reference: float) -> float:
    """``value`` against ``reference`` in percent (negative: lower)."""
    return round(100 * (value - reference) / reference, 3)
