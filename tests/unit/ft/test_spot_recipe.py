"""The spot recipe's planning and reporting (recipes/spot/spot_report.py) on hand-made worker records: the schedule
holds every fault the recipe promises, and each reported number follows from the records (batches per node, batches
trained twice or skipped, steps lost, restarts, rejoins, R)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "recipes" / "spot"))
import spot_report as report  # noqa: E402 - a recipe module, not part of the package


def _record(step: int, node: int, **extra):
    record = {
        "step": step,
        "global_step": step,
        "batch_hash": f"h{node}-{step - 1}",
        "epoch": 0,
        "batch_idx": step - 1,
        "batches_per_epoch": 100,
        "participants": 3,
        "retries": 0,
        "pid": 100 + node,
        "time": float(step),
        "step_s": 1.0,
        "comm_s": 0.2,
        "digest": f"w{step}",
    }
    return {**record, **extra}


def _run(last: int = 6) -> dict[int, list[dict]]:
    return {node: [_record(s, node) for s in range(1, last + 1)] for node in range(3)}


def test_the_plan_holds_two_kills_a_freeze_a_lighthouse_restart_and_a_period_below_the_minimum():
    faults = report.plan(3, 2, freeze_s=45, outage_s=10, below_min_s=160, quorum_timeout_s=30)
    assert [(f.kind, f.nodes) for f in faults] == [
        ("kill", (2,)),
        ("kill", (1,)),
        ("stop", (1,)),
        ("lighthouse", ()),
        ("kill", (2, 1)),
    ]
    assert faults[2].hold_s == 45 and faults[3].hold_s == 10
    below = faults[-1]
    assert 3 - len(below.nodes) < 2 and below.hold_s == 160  # one survivor: below min_replicas 2
    assert sum(len(f.nodes) for f in faults if f.kind == "kill") == 4
    # With 4 nodes and min_replicas 3, two must go for the survivors to drop below the minimum.
    assert report.plan(4, 3, freeze_s=45, outage_s=10, below_min_s=160, quorum_timeout_s=30)[-1].nodes == (3, 2)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"nodes": 2}, "nodes=2"),
        ({"min_replicas": 1}, "min_replicas=1"),
        ({"min_replicas": 3}, "min_replicas=3"),
        ({"freeze_s": 30}, "freeze_s=30"),
        ({"outage_s": 0}, "outage_s=0"),
    ],
)
def test_a_plan_that_could_not_show_its_fault_is_refused_naming_the_argument(change, named):
    arguments = {"nodes": 3, "min_replicas": 2, "freeze_s": 45, "outage_s": 10, "below_min_s": 160, **change}
    nodes, min_replicas = arguments.pop("nodes"), arguments.pop("min_replicas")
    with pytest.raises(ValueError, match=named):
        report.plan(nodes, min_replicas, **arguments, quorum_timeout_s=30)


def test_distinct_batches_and_nothing_twice_or_skipped_in_a_clean_run():
    checks = report.batch_checks(_run())
    assert checks == {
        "distinct_node_batches": True,
        "steps_with_two_or_more_nodes": 6,
        "batches_trained_twice": 0,
        "batches_skipped": 0,
        "off_position_batches": 0,
    }


def test_the_same_batch_on_two_nodes_is_not_distinct_and_counts_twice():
    records = _run()
    records[1][2]["batch_hash"] = records[0][2]["batch_hash"]
    checks = report.batch_checks(records)
    assert not checks["distinct_node_batches"] and checks["batches_trained_twice"] == 1


def test_a_batch_held_through_a_freeze_is_off_position_and_its_step_s_batch_is_skipped():
    records = _run()
    # Node 1 froze holding position 2 (step 3's batch) and committed it at step 5; then it follows the step again.
    records[1] = [_record(1, 1), _record(2, 1), _record(5, 1, batch_idx=2, batch_hash="h1-2"), _record(6, 1)]
    checks = report.batch_checks(records)
    assert checks["off_position_batches"] == 1 and checks["batches_skipped"] == 1
    assert checks["batches_trained_twice"] == 0 and checks["distinct_node_batches"]


def test_positions_count_over_epochs():
    record = _record(105, 0, epoch=1, batch_idx=4)
    assert report.position(record) == 104
    assert report.batch_checks({0: [record]})["batches_skipped"] == 0


def test_steps_lost_and_restarts_from_the_union_of_the_nodes_records():
    records = _run()
    del records[0][3], records[1][3], records[2][3]  # step 4 committed by nobody
    assert report.steps_lost(records) == 1
    records[2][-1]["pid"] = 999  # node 2 changed pid: a restart unless the recipe started it twice
    assert report.survivor_restarts(records, {0: 1, 1: 1, 2: 1}) == 1
    assert report.survivor_restarts(records, {0: 1, 1: 1, 2: 2}) == 0


def test_a_rejoin_is_bit_identical_only_when_every_participant_matches():
    records = _run()
    records[2] = [_record(5, 2, time=100.0), _record(6, 2, time=101.0)]
    for node in (0, 1):
        records[node][4]["time"] = 100.0
    found = report.rejoin(records, 2, after=50.0)
    assert found == {"node": 2, "rejoined_at_step": 5, "participants": 3, "global_step": 5, "bit_identical": True}
    records[0][4]["digest"] = "other"
    assert report.rejoin(records, 2, after=50.0)["bit_identical"] is False
    del records[1][4]  # a participant has not written step 5 yet: no verdict
    assert report.rejoin(records, 2, after=50.0) is None
    assert report.rejoin(records, 2, after=500.0) is None


def test_the_longest_gap_includes_the_edges_and_r_is_exchange_over_the_rest():
    records = _run()
    assert report.longest_gap(records, [0, 1], 0.5, 9.0) == 3.0  # last commit at 6, end at 9
    assert report.link_ratio(records, 3) == {"R": 0.25, "comm_s": 0.2, "compute_s": 0.8}
    assert report.link_ratio(records, 4)["R"] is None  # no step with the full quorum
    assert report.pct(0.9, 1.0) == -10.0


def test_records_cut_by_a_kill_are_skipped(tmp_path):
    lines = [json.dumps(_record(1, 0)), '{"step": 2, "glob', json.dumps({"final": True, "digest": "w"})]
    (tmp_path / "replica_0.jsonl").write_text("\n".join(lines) + "\n")
    records = report.read_records(tmp_path, 0)
    assert len(records) == 2 and len(report.steps(records)) == 1
    assert report.read_records(tmp_path, 1) == []


def test_dropped_batches_are_each_processs_last_count_summed():
    records = _run()
    for record in records[1]:
        record["abandoned"] = 1 if record["step"] >= 3 else 0  # one in-place heal dropped a batch
    records[2][-1] = {**records[2][-1], "pid": 99, "abandoned": 0}  # a restarted process counts from 0 again
    assert report.dropped_batches(records) == 1
    assert report.dropped_batches(_run()) == 0  # journals without the field: nothing dropped
