"""Multi-rank replica groups in FlexDeMo's fault-tolerant mode: 2 nodes of 2 ranks each, FSDP2 inside every node.

Each rank is a process of its own (tests/dist/ft_group_worker.py, the FlexDeMo runtime driven directly;
tests/dist/ft_group_trainer_worker.py, ``Trainer(devices=2, strategy=FlexDeMoStrategy(...))``), started like one rank of
its node's own ``torchrun --nnodes 1 --nproc-per-node 2`` (its node's ``MASTER_PORT``, ``RANK`` 0 or 1,
``WORLD_SIZE=2``, ``REPLICA_GROUP_ID``), all nodes behind one live lighthouse (started here). Rank ``i`` of a node joins
torchft's Manager as group rank ``i``; its DeMo exchange and its recovery go to rank ``i`` of the other node, carrying
its own FSDP2 shards.

Both ranks of one node are SIGKILLed mid-run: the other node keeps stepping without a restart (same pids, the committed
step keeps rising, 1 participant). The node is started again, both of its ranks are healed from the survivor's ranks
(each from the same group rank, its local shards through the pickle-free transport) and after their first committed
step every rank's shards equal the survivor's rank's bit for bit, and again at the end.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torchft")
pytest.importorskip("safetensors")

from tests.dist.ft_support import lighthouse_and_nodes, read_records, start_node, wait_for

WORKERS = {
    "runtime": Path(__file__).resolve().parent / "ft_group_worker.py",
    "trainer": Path(__file__).resolve().parent / "ft_group_trainer_worker.py",
}
RANKS = 2


def _steps(out: Path, group: int, rank: int, *, final: bool = False) -> list[dict]:
    return read_records(out / f"group_{group}_rank_{rank}.jsonl", final=final)


def _start_node(worker: str, address: str, group: int, out: Path) -> dict[str, subprocess.Popen]:
    """Both ranks of one node, as its own launch would start them (the Trainer's nodes read their shards)."""
    extra = ("--shard-groups", "2") if worker == "trainer" else ()
    return start_node(WORKERS[worker], address, group, out, RANKS, *extra)


def _at(out: Path, group: int, rank: int, step: int) -> dict | None:
    return next((r for r in _steps(out, group, rank) if r["step"] == step), None)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("worker", sorted(WORKERS))
def test_a_killed_two_rank_node_leaves_the_survivor_stepping_and_rejoins_with_bit_identical_shards(tmp_path, worker):
    ranks = range(RANKS)
    with lighthouse_and_nodes(min_replicas=1, join_timeout_ms=2000) as (address, procs):
        procs.update(_start_node(worker, address, 0, tmp_path))
        procs.update(_start_node(worker, address, 1, tmp_path))
        wait_for(
            lambda: all(
                len([r for r in _steps(tmp_path, g, k) if r["participants"] == 2]) >= 2 for g in (0, 1) for k in ranks
            ),
            "both nodes to commit 2 steps together",
            procs,
        )
        # Together, every rank's shards equal the other node's same rank (the first quorum synced differing inits).
        both = max(r["step"] for r in _steps(tmp_path, 1, 0) if r["participants"] == 2)
        for rank in ranks:
            wait_for(lambda rank=rank: _at(tmp_path, 0, rank, both) is not None, "node 0 at the same step", procs)
            assert _at(tmp_path, 0, rank, both)["digest"] == _at(tmp_path, 1, rank, both)["digest"], rank
        assert _at(tmp_path, 0, 0, both)["digest"] != _at(tmp_path, 0, 1, both)["digest"]  # two different shards
        survivor_pids = {k: _steps(tmp_path, 0, k)[-1]["pid"] for k in ranks}

        for rank in ranks:  # the whole node goes: both of its ranks
            procs[f"group 1 rank {rank}"].send_signal(signal.SIGKILL)
        for rank in ranks:
            procs.pop(f"group 1 rank {rank}").wait()
        killed_at = max(r["step"] for k in ranks for r in _steps(tmp_path, 1, k))
        wait_for(
            lambda: all(len([r for r in _steps(tmp_path, 0, k) if r["participants"] == 1]) >= 3 for k in ranks),
            "the surviving node to commit 3 steps alone",
            procs,
        )
        before = {k: len(_steps(tmp_path, 1, k)) for k in ranks}

        procs.update(_start_node(worker, address, 1, tmp_path))
        wait_for(
            lambda: all(len(_steps(tmp_path, 1, k)) > before[k] for k in ranks),
            "both restarted ranks to commit a step",
            procs,
        )
        for rank in ranks:
            first = _steps(tmp_path, 1, rank)[before[rank]]
            assert first["pid"] != _steps(tmp_path, 1, rank)[0]["pid"], "the restarted rank is a new process"
            assert first["step"] > killed_at + 3, (first, killed_at)  # healed to the survivor's step, not from 0
            wait_for(
                lambda rank=rank, first=first: _at(tmp_path, 0, rank, first["step"]) is not None, "survivor", procs
            )
            peer = _at(tmp_path, 0, rank, first["step"])
            assert first["digest"] == peer["digest"], f"rank {rank} of the rejoined node differs after its first step"
            assert first["participants"] == peer["participants"] == 2
            if "global_step" in first:  # the Trainer counts committed steps: the rejoined node took the survivor's
                assert first["global_step"] == first["step"] == peer["global_step"], (first, peer)

        last = max(r["step"] for g in (0, 1) for k in ranks for r in _steps(tmp_path, g, k))
        stop = last + 10  # margin: every rank reads it before it gets there
        (tmp_path / "stop").write_text(str(stop))
        for name, proc in procs.items():
            assert proc.wait(timeout=120) == 0, f"{name} failed"
        for rank in ranks:
            finals = [_steps(tmp_path, g, rank, final=True)[-1] for g in (0, 1)]
            assert [f["step"] for f in finals] == [stop, stop], finals
            assert finals[0]["digest"] == finals[1]["digest"], f"rank {rank}: the nodes differ at the end"
            survivor = _steps(tmp_path, 0, rank)
            assert {r["pid"] for r in survivor} == {survivor_pids[rank]}, "a survivor rank was restarted"
            steps = [r["step"] for r in survivor]
            assert all(b > a for a, b in zip(steps, steps[1:], strict=False)), f"rank {rank} went back: {steps}"
            assert 1 in [r["participants"] for r in survivor]
