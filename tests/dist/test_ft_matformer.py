"""Tiered MatFormer in the fault-tolerant mode, as separate processes: a lighthouse (started here) and 3 nodes of one
rank each (tests/dist/ft_matformer_worker.py: ``Trainer(strategy=MatFormerStrategy(settings=MatFormerSettings(
tiers=[0, 1, 1], slice_weights=False, fault_tolerance=...)))`` on a tiny Llama, gloo on CPU), each started like a
one-rank torchrun job of its own.

Nodes of different tiers hold bit-identical full models after every step (the per-region mean over the quorum's
participants, formed from the same authenticated bytes in the same order everywhere). The tier-0 node is SIGKILLed
mid-run: the two tier-1 survivors step on without a restart (same pid, the committed step rising, 2 participants,
the units beyond their width getting a zero gradient). It is restarted, healed from a tier-1 peer (weights, AdamW
state, Trainer position) before its first forward, and after its first committed step equals the survivors bit for
bit; at the end all three are identical. ``global_step`` counts committed steps on every node, and
``comm/inter/bytes_sent_step`` is ``(n - 1) (S + 32)`` for the dense payload of ``S`` bytes.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torchft")
pytest.importorskip("safetensors")

from tests.dist.ft_support import lighthouse_and_nodes, read_records, start_node, wait_for

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "ft_matformer_worker.py"
FULL, HALF = [64, 64], [32, 32]  # the tiny Llama's two FFNs: tier-0 and tier-1 widths


def _records(out: Path, node: int) -> list[dict]:
    return read_records(out / f"node_{node}.jsonl") + read_records(out / f"node_{node}.jsonl", final=True)


def _steps(out: Path, node: int) -> list[dict]:
    return read_records(out / f"node_{node}.jsonl")


def _at(out: Path, node: int, step: int) -> dict | None:
    return next((r for r in _steps(out, node) if r["step"] == step), None)


def _start(address: str, node: int, out: Path) -> subprocess.Popen:
    (proc,) = start_node(WORKER, address, node, out, 1).values()  # one rank: its own one-rank torchrun job
    return proc


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_tier0_node_leaves_the_tier1_nodes_stepping_and_rejoins_bit_identical(tmp_path):
    with lighthouse_and_nodes() as (address, procs):
        for node in range(3):
            procs[node] = _start(address, node, tmp_path)
        wait_for(
            lambda: all(len([r for r in _steps(tmp_path, i) if r["participants"] == 3]) >= 2 for i in range(3)),
            "3 nodes to commit 2 steps together",
            procs,
        )
        # Tiers 0, 1, 1 and yet one model: every node's weights are the same bits after a step of all three.
        together = max(r["step"] for r in _steps(tmp_path, 2) if r["participants"] == 3)
        wait_for(lambda: all(_at(tmp_path, i, together) for i in range(3)), "every node at the same step", procs)
        records = [_at(tmp_path, i, together) for i in range(3)]
        assert len({r["digest"] for r in records}) == 1, records
        assert sorted(records[0]["widths"]) == [HALF, HALF, FULL], records[0]
        survivor_pids = {i: _steps(tmp_path, i)[-1]["pid"] for i in (1, 2)}

        procs[0].send_signal(signal.SIGKILL)  # the only tier-0 node
        procs[0].wait()
        killed_at = max(r["step"] for r in _steps(tmp_path, 0))
        survivors = {k: v for k, v in procs.items() if k != 0}

        def alone(node: int) -> list[dict]:  # steps the two survivors committed without the tier-0 node
            return [r for r in _steps(tmp_path, node) if r["participants"] == 2 and r["step"] > killed_at]

        wait_for(
            lambda: all(len(alone(i)) >= 3 for i in (1, 2)), "the tier-1 survivors to commit 3 steps as 2", survivors
        )
        assert all(r["widths"] == [HALF, HALF] for r in alone(1)), alone(1)  # units 32-63 untrained: zero gradient
        before = len(_steps(tmp_path, 0))

        procs[0] = _start(address, 0, tmp_path)
        wait_for(lambda: len(_steps(tmp_path, 0)) > before, "the restarted tier-0 node to commit a step", procs)
        first = _steps(tmp_path, 0)[before]
        assert first["pid"] != _steps(tmp_path, 0)[0]["pid"], "the restarted node is a new process"
        assert first["step"] > killed_at + 3, (first, killed_at)  # healed to the survivors' step, not from 0
        assert first["global_step"] == first["step"], first  # Lightning's counter took the survivors' count
        wait_for(lambda: all(_at(tmp_path, i, first["step"]) for i in (1, 2)), "the survivors at that step", procs)
        for i in (1, 2):
            peer = _at(tmp_path, i, first["step"])
            assert peer["digest"] == first["digest"], f"the rejoined tier-0 node differs from node {i}"
            assert peer["participants"] == first["participants"] == 3

        last = max(r["step"] for i in range(3) for r in _steps(tmp_path, i))
        stop = last + 3
        (tmp_path / "stop").write_text(str(stop))  # every node's max_steps
        for node, proc in procs.items():
            assert proc.wait(timeout=180) == 0, f"node {node} failed"
        finals = [next(r for r in _records(tmp_path, i) if r.get("final")) for i in range(3)]
        assert len({f["digest"] for f in finals}) == 1, finals
        assert [f["global_step"] for f in finals] == [stop] * 3, finals
        for i in range(3):
            for record in _steps(tmp_path, i):
                assert record["global_step"] == record["step"], record
                if record["retries"] == 0:  # one all-gather of the payload and its 32-byte tag per try
                    expected = (record["participants"] - 1) * (record["payload_bytes"] + 32)
                    assert record["inter_bytes_sent"] == expected > 0, record
        for i in (1, 2):
            steps = _steps(tmp_path, i)
            assert {r["pid"] for r in steps} == {survivor_pids[i]}, f"survivor {i} was restarted"
            numbers = [r["step"] for r in steps]
            assert all(b > a for a, b in zip(numbers, numbers[1:], strict=False)), numbers
