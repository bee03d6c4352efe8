"""Pipeline schedules and the rank layout (pure functions; no processes)."""

from __future__ import annotations

import pytest

from lightning_hetero.pipeline.layout import PipelineLayout
from lightning_hetero.subspace_pipeline.schedules import Action, build_schedule, check_schedule


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("num_stages", "n_microbatches"), [(1, 3), (2, 1), (2, 4), (4, 2), (4, 8)])
def test_every_microbatch_runs_forward_then_backward_in_order(schedule, num_stages, n_microbatches):
    for stage in range(num_stages):
        actions = build_schedule(schedule, stage, num_stages, n_microbatches)
        forwards = [a.microbatch for a in actions if a.kind == "F"]
        backwards = [a.microbatch for a in actions if a.kind == "B"]
        # increasing order per direction: messages on one link never overtake each other
        assert forwards == backwards == list(range(n_microbatches))
        for m in range(n_microbatches):
            assert actions.index(Action("F", m)) < actions.index(Action("B", m))


def test_gpipe_runs_all_forwards_first():
    assert build_schedule("gpipe", 1, 2, 3) == [Action("F", m) for m in range(3)] + [Action("B", m) for m in range(3)]


def _peak_in_flight(actions: list[Action]) -> int:
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def test_1f1b_bounds_microbatches_in_flight_by_the_stages_left():
    num_stages, n_microbatches = 4, 8
    for stage in range(num_stages):
        one_f_one_b = build_schedule("1f1b", stage, num_stages, n_microbatches)
        assert _peak_in_flight(one_f_one_b) == num_stages - stage  # GPipe would hold all 8
        assert _peak_in_flight(build_schedule("gpipe", stage, num_stages, n_microbatches)) == n_microbatches
    assert build_schedule("1f1b", 3, 4, 3) == [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1),
                                                Action("F", 2), Action("B", 2)]  # fmt: skip


def test_schedule_names_and_errors():
    assert check_schedule("1F1B") == "1f1b" and check_schedule("GPipe") == "gpipe"
    with pytest.raises(ValueError, match=r"interleaved schedules need several stages per rank.*'gpipe', '1f1b'"):
        check_schedule("interleaved")
    with pytest.raises(ValueError, match=r"SubspacePipelineSettings\.schedule='zigzag' is not a known schedule"):
        check_schedule("zigzag")
    with pytest.raises(ValueError, match="n_microbatches=0"):
        build_schedule("gpipe", 0, 2, 0)


def test_stage_major_layout_puts_one_stage_per_node():
    layout = PipelineLayout(num_stages=4, data_parallel_size=2)  # e.g. 4 nodes x 2 processes
    assert [layout.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.dp_rank_of(r) for r in range(8)] == [0, 1] * 4
    assert layout.pipeline_ranks(1) == [1, 3, 5, 7]
    assert layout.replica_ranks(2) == [4, 5]
    with pytest.raises(ValueError, match=r"world has 6 processes but num_stages=4 x data_parallel_size=2 needs 8"):
        layout.check_world(6)
