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


class _Replica:
    """A stand-in for FaultTolerantReplica: quorums heal to ``heal_to`` when set; ``commits`` says each try's fate."""

    def __init__(self, step: int, commits: list[bool], heal_at_quorum: int | None = None, heal_to: int = 0) -> None:
        self.step, self.commits = step, commits
        self.quorums = 0
        self.heal_at_quorum, self.heal_to = heal_at_quorum, heal_to

    def start_step(self) -> None:
        self.quorums += 1
        if self.quorums == self.heal_at_quorum:
            self.step = self.heal_to  # healed in place from a peer that is ahead

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return 2

    def step_optimizer(self, run: object) -> bool:
        run()  # type: ignore[operator]
        committed = self.commits.pop(0)
        self.step += int(committed)
        return committed


def _quorum(replica: _Replica) -> QuorumSteps:
    quorum = QuorumSteps()
    quorum.replica = replica
    quorum.begin_batch()
    return quorum


def test_a_try_that_fails_and_is_healed_past_its_step_drops_the_batch_instead_of_training_it() -> None:
    quorum = _quorum(_Replica(step=3, commits=[False], heal_at_quorum=2, heal_to=7))
    tries: list[str] = []
    out = quorum.committed_step(lambda: tries.append("step"), retry=True, abandon=lambda: tries.append("drop") or "d")
    assert out == "d" and tries == ["step", "drop"]
    assert quorum.last_abandoned and quorum.last_commit is False and quorum.step_open  # the quorum serves the next
    assert quorum.metrics()["ft/abandoned_batches"] == 1.0 and quorum.metrics()["ft/committed"] == 0.0
    quorum.begin_batch()  # the next batch is the committed step's: it trains in the quorum already joined
    quorum.replica.commits.append(True)
    quorum.committed_step(lambda: tries.append("step"), retry=True, abandon=lambda: tries.append("drop"))
    assert tries[-1] == "step" and not quorum.last_abandoned and quorum.committed_steps == 8


def test_a_batch_whose_step_was_committed_before_its_forward_is_dropped_without_a_step() -> None:
    quorum = _quorum(_Replica(step=3, commits=[], heal_at_quorum=1, heal_to=5))
    quorum.start_step()  # the batch start's quorum heals in place
    tries: list[str] = []
    quorum.committed_step(lambda: tries.append("step"), retry=True, abandon=lambda: tries.append("drop"))
    assert tries == ["drop"] and quorum.abandoned_batches == 1


def test_without_abandon_or_a_heal_the_step_is_retried_until_it_commits() -> None:
    quorum = _quorum(_Replica(step=3, commits=[False, True], heal_at_quorum=2, heal_to=7))
    tries: list[str] = []
    quorum.committed_step(lambda: tries.append("step"), retry=True)  # no abandon given: the batch is retried
    assert tries == ["step", "step"] and quorum.last_retries == 1 and not quorum.last_abandoned
    steady = _quorum(_Replica(step=3, commits=[False, True]))
    steady.committed_step(lambda: None, retry=True, abandon=lambda: pytest.fail("not overtaken"))
    assert steady.last_commit and steady.committed_steps == 4
