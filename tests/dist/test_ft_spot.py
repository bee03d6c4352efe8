"""Spot workers on torchft, as separate processes: a lighthouse (started here) and 3 replica groups of 1 process each
(tests/dist/ft_replica_worker.py: :class:`~lightning_hetero.ft.replicas.FaultTolerantReplica`, gloo on CPU).

One replica is SIGKILLed mid-run: the survivors step on without a restart (same pid, the step counter keeps rising,
participants drop to 2, no step is committed twice or skipped). It is restarted, rejoins, is healed through our
pickle-free transport and, after its first step, its weights equal the survivors' bit for bit. A replica with
another layout then asks to join: the recovery checkpoint it gets is refused with a clear error naming the peer and
the field, and the others go on.
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
pytest.importorskip("safetensors")

from tests.dist.ft_support import lighthouse_and_nodes, read_records, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "ft_replica_worker.py"


def _steps(out: Path, replica: int, *, final: bool = False) -> list[dict]:
    return read_records(out / f"replica_{replica}.jsonl", final=final)


def _wait(condition, what: str, procs: dict | None = None) -> None:
    wait_for(condition, what, {k: v for k, v in (procs or {}).items() if k != "impostor"}, timeout=120.0)


def _start(address: str, replica: int, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
    log = (out / f"worker_{replica}_{time.monotonic_ns()}.log").open("w")
    command = [sys.executable, str(WORKER), "--lighthouse", address, "--replica-id", str(replica), "--out", str(out)]
    command.append("--forbid-pickle")  # a heal through torchft's stock (unpickling) transports would fail
    return subprocess.Popen([*command, *extra], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


@pytest.mark.timeout(420)
def test_a_killed_replica_leaves_the_survivors_stepping_and_rejoins_bit_identical(tmp_path):
    with lighthouse_and_nodes() as (address, procs):
        for replica in range(3):
            procs[str(replica)] = _start(address, replica, tmp_path)
        _wait(
            lambda: all(len([r for r in _steps(tmp_path, i) if r["participants"] == 3]) >= 3 for i in range(3)),
            "3 replicas to commit 3 steps together",
            procs=procs,
        )
        survivors_pids = {i: _steps(tmp_path, i)[-1]["pid"] for i in (0, 1)}

        procs["2"].send_signal(signal.SIGKILL)
        procs["2"].wait()
        killed_at = max(r["step"] for r in _steps(tmp_path, 2))
        _wait(
            lambda: all(len([r for r in _steps(tmp_path, i) if r["participants"] == 2]) >= 3 for i in (0, 1)),
            "the survivors to commit 3 steps as 2",
            procs={k: v for k, v in procs.items() if k != "2"},
        )
        before_rejoin = len(_steps(tmp_path, 2))

        procs["2"] = _start(address, 2, tmp_path)
        _wait(lambda: len(_steps(tmp_path, 2)) > before_rejoin, "the restarted replica to commit a step", procs=procs)
        first = _steps(tmp_path, 2)[before_rejoin]
        assert first["pid"] != _steps(tmp_path, 2)[0]["pid"], "the restarted replica is a new process"
        assert first["step"] > killed_at + 3, (first, killed_at)  # it joined at the survivors' step, not at 0
        _wait(lambda: all(any(r["step"] == first["step"] for r in _steps(tmp_path, i)) for i in (0, 1)), "peers")
        for i in (0, 1):
            peer = next(r for r in _steps(tmp_path, i) if r["step"] == first["step"])
            assert peer["digest"] == first["digest"], (
                f"the rejoined replica differs from replica {i} after its first step"
            )
            assert peer["participants"] == first["participants"] == 3

        # A replica whose own layout differs (hidden width 24): the checkpoint a live peer sends is refused.
        procs["impostor"] = _start(address, 3, tmp_path, "--hidden", "24")
        assert procs["impostor"].wait(timeout=120) == 3
        error = (tmp_path / "replica_3.error").read_text()
        assert "PeerPayloadError" in error and "recovery checkpoint from replica" in error, error
        assert "user/default/model/0.weight" in error and "this replica holds F32 [24, 8]" in error, error

        last = max(r["step"] for i in range(3) for r in _steps(tmp_path, i))
        (tmp_path / "stop").write_text(str(last + 3))
        for name in ("0", "1", "2"):
            assert procs[name].wait(timeout=120) == 0, f"worker {name} failed"

        finals = [_steps(tmp_path, i, final=True)[0] for i in range(3)]
        assert len({f["digest"] for f in finals}) == 1, finals
        committed: set[int] = set()
        for i in (0, 1):
            steps = [r["step"] for r in _steps(tmp_path, i)]
            committed.update(steps)
            # Never repeated, never reset: a survivor whose commit failed while the other's succeeded (a peer left
            # mid-collective) is healed from it at the next quorum, in place, and goes on from the newer step.
            assert all(b > a for a, b in zip(steps, steps[1:], strict=False)), f"replica {i} went back: {steps}"
            assert {r["pid"] for r in _steps(tmp_path, i)} == {survivors_pids[i]}, "a survivor was restarted"
            counts = [r["participants"] for r in _steps(tmp_path, i)]
            assert 2 in counts and counts[-1] == 3, counts
        assert committed == set(range(1, max(committed) + 1)), "the survivors together lost a step"
