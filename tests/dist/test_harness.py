"""run_distributed: ordered results, prompt failure reporting, timeouts, and no orphan processes afterwards."""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_hetero.testing import DistributedRankError, find_free_port, run_distributed
from lightning_hetero.testing import multiprocess as harness

pytestmark = pytest.mark.timeout(120)


def _spawned_children() -> set[int]:
    """Pids of live or zombie children of this process, except multiprocessing's long-lived resource tracker."""
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat_file:
                fields = stat_file.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline_file:
                cmdline = cmdline_file.read()
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == os.getpid() and b"resource_tracker" not in cmdline:
            children.add(int(entry))
    return children


@pytest.fixture
def no_leftover_processes() -> Any:
    """Fail the test if it leaves any child process behind (the harness must join or kill every rank)."""
    before = _spawned_children()
    yield
    assert multiprocessing.active_children() == []
    assert _spawned_children() - before == set()


# ------------------------------------------------------------------------------- functions run in the children
def _report(rank: int, world_size: int, tag: str, scale: int = 1) -> dict[str, Any]:
    time.sleep(0.3 * (world_size - 1 - rank))  # finish in reverse rank order: results must still come back sorted
    total = torch.tensor([float(rank * scale)])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": world_size,
        "tag": tag,
        "group_rank": dist.get_rank(),
        "sum": total.item(),
        "env": {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "EXTRA")},
        "threads": torch.get_num_threads(),
    }


def _rank1_raises_while_rank0_waits(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(0.5)  # let rank 0 enter the collective first
        raise ValueError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(1))  # blocks: rank 1 never joins


def _rank0_hangs(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(300)
    return rank


def _rank1_dies_silently(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    time.sleep(300)
    return rank


# ------------------------------------------------------------------------------------------------------ tests
def test_results_come_back_ordered_by_rank(no_leftover_processes: None) -> None:
    results = run_distributed(_report, 3, "hello", scale=2, env={"EXTRA": "yes"})
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, result in enumerate(results):
        assert result["world_size"] == 3 and result["group_rank"] == rank and result["tag"] == "hello"
        assert result["sum"] == 2.0 * (0 + 1 + 2)
        assert result["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "OMP_NUM_THREADS": "1",
            "EXTRA": "yes",
        }
        assert result["threads"] == 1


def test_failing_rank_is_reported_promptly(no_leftover_processes: None) -> None:
    started = time.monotonic()
    with pytest.raises(DistributedRankError) as error:
        run_distributed(_rank1_raises_while_rank0_waits, 2, timeout=60.0)
    elapsed = time.monotonic() - started
    assert error.value.rank == 1
    message = str(error.value)
    assert message.startswith("rank 1 failed:")
    assert "ValueError: deliberate failure on rank 1" in message
    assert "Traceback (most recent call last)" in message and "_rank1_raises_while_rank0_waits" in message
    assert elapsed < 30.0, f"took {elapsed:.1f} s: rank 0 was not stopped before gloo's 60 s timeout"


def test_hang_times_out_and_kills_every_rank(no_leftover_processes: None) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError) as error:
        run_distributed(_rank0_hangs, 2, timeout=5.0)
    elapsed = time.monotonic() - started
    # rank 1 normally finishes; on a very loaded box it may not have started in time, and is named too
    assert re.search(r"ranks \[0(, 1)?\] did not finish within 5 s", str(error.value)), str(error.value)
    assert elapsed < 20.0


def test_rank_exiting_without_a_report_is_an_error(no_leftover_processes: None) -> None:
    with pytest.raises(DistributedRankError, match="exited with code 3 without reporting") as error:
        run_distributed(_rank1_dies_silently, 2, timeout=60.0)
    assert error.value.rank == 1


def test_keyboard_interrupt_in_the_parent_cleans_up(
    no_leftover_processes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(results: Any, wait: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "_next_message", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_distributed(_rank0_hangs, 2, timeout=60.0)


def test_find_free_port_is_bindable() -> None:
    import socket

    port = find_free_port()
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_distributed(_rank0_hangs, 0)
