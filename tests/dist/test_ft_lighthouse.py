"""The lighthouse is killed and restarted on the same address 10 s later, under 2 live replica groups
(``torchft_lighthouse`` processes on one fixed port and tests/dist/ft_replica_worker.py processes, gloo on CPU).

The replicas wait (quorum attempts of 5 s fail and are asked again, ``FaultToleranceSettings.wait_for_replicas_s``),
find the restarted lighthouse, and train on: no process restarted, no committed step lost, both identical at the end.
The 60 s outage is measured by recipes/spot/spot_lighthouse_restart.py (docs/spot.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from lightning_hetero.testing import find_free_port  # noqa: E402
from tests.dist.ft_support import read_records, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "ft_replica_worker.py"
OUTAGE_S = 10.0
QUORUM_TIMEOUT_S = 5.0


def _lighthouse(port: int, log: Path) -> subprocess.Popen:
    """docs/spot.md's lighthouse command, on ``port``."""
    command = ["torchft_lighthouse", "--bind", f"[::]:{port}", "--min_replicas", "2"]
    command += ["--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1500"]
    return subprocess.Popen(
        command, env={**os.environ, "RUST_LOG": "warn"}, stdout=log.open("a"), stderr=subprocess.STDOUT
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_lighthouse_restarted_on_the_same_address_loses_nothing(tmp_path):
    port = find_free_port()
    lighthouse = _lighthouse(port, tmp_path / "lighthouse.log")
    env = {**os.environ, "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHFT_QUORUM_RETRIES", None)  # the setting's default, not the environment
    procs: dict[int, subprocess.Popen] = {}
    try:
        for node in (0, 1):
            command = [sys.executable, str(WORKER), "--lighthouse", f"http://localhost:{port}", "--replica-id"]
            command += [str(node), "--out", str(tmp_path), "--quorum-timeout", str(QUORUM_TIMEOUT_S)]
            log = (tmp_path / f"worker_{node}.log").open("w")
            procs[node] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

        def steps(node: int) -> list[dict]:
            return read_records(tmp_path / f"replica_{node}.jsonl")

        wait_for(lambda: all(len(steps(n)) >= 10 for n in procs), "10 commits each", procs, timeout=180)
        pids = {n: steps(n)[-1]["pid"] for n in procs}
        lighthouse.send_signal(signal.SIGKILL)
        lighthouse.wait()
        killed_at = time.time()
        time.sleep(OUTAGE_S)
        lighthouse = _lighthouse(port, tmp_path / "lighthouse.log")
        outage = time.time() - killed_at
        before = {n: len(steps(n)) for n in procs}
        wait_for(
            lambda: all(len(steps(n)) >= before[n] + 5 for n in procs),
            "5 commits each after the restart",
            procs,
            timeout=QUORUM_TIMEOUT_S + OUTAGE_S + 120,
        )
        stop = max(r["step"] for n in procs for r in steps(n)) + 2
        (tmp_path / "stop").write_text(str(stop))
        for node, proc in procs.items():
            assert proc.wait(timeout=120) == 0, f"worker {node} failed"
    finally:
        for proc in [*procs.values(), lighthouse]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    records = {n: steps(n) for n in procs}
    for node in procs:
        assert {r["pid"] for r in records[node]} == {pids[node]}, f"worker {node} was restarted"
        assert len(records[node]) - before[node] >= 5, records[node][-5:]
    committed = {r["step"] for node in procs for r in records[node]}
    assert committed == set(range(1, max(committed) + 1)), "a committed step was lost"
    finals = [read_records(tmp_path / f"replica_{n}.jsonl", final=True) for n in procs]
    assert all(len(f) == 1 for f in finals) and finals[0][0]["digest"] == finals[1][0]["digest"], finals
    # They did wait through the outage: the longest gap between two commits of a replica spans it.
    stall = max(
        b["time"] - a["time"]
        for node in procs
        for a, b in zip(records[node], records[node][1:], strict=False)
        if b["time"] > killed_at - 5
    )
    assert stall >= outage - 1, (stall, outage)
    log = (tmp_path / "worker_0.log").read_text()
    assert (
        "waiting for the lighthouse" in log and "Cancelled" not in log.split("waiting for the lighthouse", 1)[1][:200]
    )
