"""QuorumSteps outside a quorum (every call a no-op, the step just runs) and the one-launch-per-node launch check."""

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
    ("nodes", "ranks", "shard_size", "message"),
    [
        (2, 1, None, r"spans 2 nodes.*num_nodes=1.*REPLICA_GROUP_ID"),
        (2, 4, 4, r"spans 2 nodes"),
        (
            1,
            4,
            2,
            r"shard_size=2.*4 ranks of this replica group would hold 2 model copies.*shard_size=None \(or.*4\)",
        ),
    ],
)
def test_one_launch_per_node_holding_one_model_copy_is_enforced_naming_the_fix(
    nodes: int, ranks: int, shard_size: int | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_fault_tolerant_world(FaultToleranceSettings(), "FlexDeMoStrategy", nodes, ranks, shard_size)


@pytest.mark.parametrize(("ranks", "shard_size"), [(1, None), (2, None), (2, 2), (8, 8), (1, 1)])
def test_a_node_of_several_ranks_sharding_one_copy_is_accepted(ranks: int, shard_size: int | None) -> None:
    check_fault_tolerant_world(FaultToleranceSettings(), "FlexDeMoStrategy", 1, ranks, shard_size)
