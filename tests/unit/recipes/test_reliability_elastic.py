"""``recipes/reliability/reliability_elastic.py``'s measurement of one preemption, on a synthetic rank-0 event log.

The recipe itself (two torchrun agents, a node killed mid-run) takes minutes and is run by hand; this checks that the
steps and seconds it reports are the ones its docstring defines.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "recipes" / "reliability"))

from reliability_elastic import measure  # noqa: E402


def _step(step: int, time: float, world_size: int) -> dict:
    return {"event": "step", "step": step, "time": time, "world_size": world_size, "loss": 5.0 - step / 10}


def test_steps_and_seconds_lost_follow_the_definitions():
    events = [{"event": "spawned", "time": 0.0}, {"event": "start", "time": 1.0, "resumed_from": 0, "load_seconds": 0}]
    events += [_step(step, 1.0 + step, 2) for step in range(1, 14)]  # steps 1..13 at t = 2..14, checkpoint at 10
    killed_at = 14.5
    events += [{"event": "spawned", "time": 40.0}]
    events += [{"event": "start", "time": 50.0, "resumed_from": 10, "load_seconds": 0.5}]
    events += [_step(step, 50.0 + 2 * (step - 10), 1) for step in range(11, 16)]  # one node: 2 s per step
    result = measure(events, killed_at)
    assert (result["world_size_before"], result["world_size_after"]) == (2, 1)
    assert (result["step_reached_before_kill"], result["resumed_from_checkpoint_step"]) == (13, 10)
    assert result["steps_lost"] == 3
    assert result["seconds_lost"] == pytest.approx(56.0 - 14.0)  # step 13 again at t = 56, first at t = 14
    assert result["seconds_kill_to_first_step"] == pytest.approx(52.0 - 14.5)
    assert result["parts"] == pytest.approx(
        {
            "failure_detected_and_rendezvous": 40.0 - 14.5,
            "worker_start_and_checkpoint_load": 10.0,
            "checkpoint_load": 0.5,
            "redo_lost_steps": 6.0,
        }
    )
    assert result["mean_step_seconds_before"] == pytest.approx(1.0)
    assert result["mean_step_seconds_after"] == pytest.approx(2.0)
    assert result["final_step"] == 15
