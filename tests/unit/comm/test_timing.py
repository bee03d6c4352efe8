"""Communication timing metrics read one monotonic wall clock and never exceed the wall-clock time they describe.

``comm_seconds`` is the union of the buckets' in-flight spans (overlapping buckets count once), a start that is not a
wall-clock reading (``0.0``) is refused, and a synchronous exchange (the fault-tolerant Manager's) is all waited for,
so its hidden fraction is 0. A fault-tolerant FlexDeMo Trainer step: tests/unit/flexdemo/test_comm_timing.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_hetero.comm.timing import union_seconds, wall_clock
from lightning_hetero.replication.base import Bucket
from lightning_hetero.replication.dense import FullReplicator


def test_union_counts_overlapping_spans_once():
    assert union_seconds([]) == 0.0
    assert union_seconds([(10.0, 12.0)]) == 2.0
    assert union_seconds([(10.0, 14.0), (11.0, 12.0), (13.0, 15.0)]) == 5.0  # nested and chained
    assert union_seconds([(20.0, 21.0), (10.0, 12.0)]) == 3.0  # disjoint, any order
    assert union_seconds([(8.0, 10.0), (1.0, 12.0)]) == 11.0  # a later-ending span that started first


@pytest.mark.parametrize("span", [(0.0, 5.0), (-1.0, 5.0), (5.0, 4.0)])
def test_a_span_that_is_not_a_wall_clock_reading_is_refused(span):
    with pytest.raises(ValueError, match=r"wall_clock\(\)"):
        union_seconds([span])


def test_a_bucket_without_a_start_reading_is_refused():
    empty = torch.empty(0)
    with pytest.raises(ValueError, match=r"Bucket.launched_at must be a wall_clock\(\) reading"):
        Bucket([], "reduce", empty, empty, None, 0.0, False, [])


class _SlowWork:
    """A collective that completes when waited for, after ``seconds`` (the wait is what the step blocks on)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self) -> bool:
        time.sleep(self.seconds)
        return True


def _buckets(replicator: FullReplicator, count: int) -> list[Bucket]:
    return [replicator.launch([replicator.encode(key, torch.ones(3))]) for key in range(count)]


def test_overlapping_buckets_report_at_most_the_wall_time_and_a_hidden_fraction_in_range():
    replicator = FullReplicator()
    replicator.start_step([])
    began = wall_clock()
    buckets = _buckets(replicator, 5)  # launched together, finished one after another: their spans overlap
    for bucket in buckets:
        bucket.work = _SlowWork(0.01)
    for bucket in buckets:
        replicator.finish(bucket)
    wall = wall_clock() - began
    stats = replicator.stats
    assert 0.05 <= stats["wait_seconds"] <= stats["comm_seconds"] <= wall
    # The old sum of launch-to-completion spans counted the first wait five times, the second four times, ...
    assert sum(wall_clock() - bucket.launched_at for bucket in buckets) > wall


def test_a_synchronous_exchange_is_all_waited_for_and_hides_nothing():
    replicator = FullReplicator()
    replicator.start_step([])
    began = wall_clock()
    for _ in range(3):
        (bucket,) = _buckets(replicator, 1)
        time.sleep(0.005)  # the exchange itself, inside launch
        bucket.completed_at = wall_clock()
        replicator.finish(bucket)
    wall = wall_clock() - began
    stats = replicator.stats
    assert 0 < stats["comm_seconds"] <= wall
    assert stats["wait_seconds"] == pytest.approx(stats["comm_seconds"])  # hidden fraction 1 - wait / comm = 0


def test_a_new_step_starts_its_spans_afresh():
    replicator = FullReplicator()
    replicator.start_step([])
    (bucket,) = _buckets(replicator, 1)
    bucket.completed_at = bucket.launched_at + 0.5
    replicator.finish(bucket)
    assert replicator.stats["comm_seconds"] == pytest.approx(0.5)
    replicator.start_step([])
    assert replicator.stats["comm_seconds"] == 0.0
    (bucket,) = _buckets(replicator, 1)
    bucket.completed_at = bucket.launched_at + 0.25
    replicator.finish(bucket)
    assert replicator.stats["comm_seconds"] == pytest.approx(0.25)
