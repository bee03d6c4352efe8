"""Per-node shards and the data position after an in-place heal, in Lightning Trainers as separate processes: a
lighthouse and 3 one-rank replica groups (tests/dist/ft_group_trainer_worker.py ``--shard-groups 3``: ONE stream for
all nodes, each reading its shard through ``FaultToleranceSettings.num_replica_groups``).

Node 2 is frozen (SIGSTOP) past the collective timeout while the others go on, then resumed (SIGCONT): its try fails,
it is healed in place from a peer, drops the batch it held (drawn for a step committed without it), and reads at the
committed step's position of its shard from then on. Checked over every committed step: the nodes' batches
differ, no batch is trained twice anywhere, and every node's batch is the one its shard holds at that step.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.dist.ft_support import lighthouse_and_nodes, wait_for
from tests.dist.test_ft_flexdemo import _start, _steps

pytest.importorskip("torchft")

GROUPS = 3


def _expected(node: int, step: int) -> int:
    """Batch of ``node`` at committed step ``step``: position ``step - 1`` of its shard (unshuffled: strides)."""
    return GROUPS * (step - 1) + node


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_node_reads_its_shard_and_a_node_frozen_past_the_timeout_follows_the_committed_step(tmp_path):
    shard = ("--shard-groups", str(GROUPS))
    with lighthouse_and_nodes() as (address, procs):
        for node in range(GROUPS):
            procs[str(node)] = _start(address, node, tmp_path, *shard)
        wait_for(
            lambda: all(len([r for r in _steps(tmp_path, i) if r["participants"] == 3]) >= 3 for i in range(3)),
            "3 replica groups to commit 3 steps together",
            procs,
        )
        procs["2"].send_signal(signal.SIGSTOP)
        frozen_at = len(_steps(tmp_path, 2))
        survivors = {k: v for k, v in procs.items() if k != "2"}
        wait_for(
            lambda: all(len([r for r in _steps(tmp_path, i) if r["participants"] == 2]) >= 6 for i in (0, 1)),
            "the survivors to commit 6 steps as 2 (past the 5 s timeout)",
            survivors,
        )
        procs["2"].send_signal(signal.SIGCONT)
        wait_for(lambda: len(_steps(tmp_path, 2)) >= frozen_at + 4, "the resumed node to commit 4 steps", procs)
        time.sleep(1)
        stop = max(r["step"] for i in range(3) for r in _steps(tmp_path, i)) + 3
        (tmp_path / "stop").write_text(str(stop))
        for name in ("0", "1", "2"):
            assert procs[name].wait(timeout=180) == 0, f"replica group {name} failed"

    records = {i: _steps(tmp_path, i) for i in range(3)}
    assert len({r["pid"] for r in records[2]}) == 1, "node 2 was healed in place, not restarted"
    by_step: dict[int, list[int]] = {}
    for i in range(3):
        for record in records[i]:
            by_step.setdefault(record["step"], []).append(record["batch_index"])
    for step, batches in by_step.items():
        assert len(batches) == len(set(batches)), f"step {step}: two nodes trained the same batch {batches}"
    trained = [r["batch_index"] for i in range(3) for r in records[i]]
    assert len(trained) == len(set(trained)), "a batch was trained twice"
    # Every committed batch is the node's shard at that step, node 2's after its freeze included: the batch it held
    # belonged to a step committed without it, so it was dropped (never trained), and nothing was skipped.
    off = {i: [r for r in records[i] if r["batch_index"] != _expected(i, r["step"])] for i in range(3)}
    assert not any(off.values()), off
    before, after = records[2][frozen_at - 1], records[2][frozen_at:]
    assert after[0]["step"] > before["step"] + 1, "node 2 rejoined at a later step"
    assert after[-1]["abandoned"] == before["abandoned"] + 1, "exactly the held batch was dropped"
    assert _expected(2, before["step"] + 1) not in trained, "the batch held through the freeze was trained later"
    assert len(after) >= 3 and records[2][-1]["step"] == records[0][-1]["step"] == stop
