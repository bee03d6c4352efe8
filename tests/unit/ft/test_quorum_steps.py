"""QuorumSteps outside a quorum (every call a no-op, the step just runs) and the one-rank-per-group launch check."""

from __future__ import annotations

import pytest

from lightning_hetero.ft.quorum_steps import QuorumSteps, check_fault_tolerant_world
from lightning_hetero.ft.settings import FaultToleranceSettings


def test_outside_the_mode_the_step_runs_once_and_nothing_is_reported() -> None:
    quorum = QuorumSteps()
    calls: list[int] = []
    assert quorum.committed_step(lambda: calls.append(1) or "out", retry=True) == "out"
    quorum.start_step()
    quorum.add_recovery_state("scheduler", dict, lambda state: None)
    quorum.leave()
    assert calls == [1] and not quorum.active and quorum.committed_steps == 0
    assert quorum.metrics() == {} and quorum.checkpoint_state() is None
    assert "scheduler" in quorum.recovery_state  # handed to the replica when it joins
    quorum.load_checkpoint_state({"torchft": {"step": 3, "batches_committed": 3}})  # nothing to restore into


def test_without_fault_tolerance_any_world_is_fine() -> None:
    check_fault_tolerant_world(None, "FlexDeMoStrategy", nodes=4, ranks=8)


@pytest.mark.parametrize(
    ("nodes", "ranks", "message"),
    [(2, 1, r"spans 2 nodes.*num_nodes=1.*REPLICA_GROUP_ID"), (1, 2, r"2 ranks in one replica group.*devices=1")],
)
def test_one_launch_per_node_of_one_rank_is_enforced_naming_the_fix(nodes: int, ranks: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_fault_tolerant_world(FaultToleranceSettings(), "FlexDeMoStrategy", nodes, ranks)
