"""Faults on real process groups: a hung peer inside a later-created group fails within the job's timeout; and
(slow) torchrun jobs of tests/dist/fault_worker.py that survive a killed rank, a hung peer and a crash mid-save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_hetero.reliability.faults import ENV_VAR
from lightning_hetero.testing import run_distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "fault_worker.py"


def _hung_peer_in_subgroups(rank: int, world_size: int, sleep: float) -> list[str]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_hetero.reliability import inherit_group_timeout

    inherit_group_timeout(timedelta(seconds=3))  # what the strategies' setup_environment does with their timeout
    groups = [dist.new_group([0, 1]), init_device_mesh("cpu", (2,), mesh_dim_names=("x",)).get_group("x")]
    if rank == 1:
        time.sleep(sleep)  # the hung peer: alive, connected, never answering
        return []
    errors = []
    for group in groups:
        try:
            dist.all_reduce(torch.ones(1), group=group)
            errors.append("no error")
        except RuntimeError as error:
            errors.append(str(error))
    return errors


@pytest.mark.timeout(300)
def test_a_hung_peer_fails_collectives_of_later_groups_with_a_timeout():
    """Without inheritance these groups would wait torch's 30 minutes; here each raises gloo's timeout error."""
    errors, _ = run_distributed(_hung_peer_in_subgroups, 2, 20.0, timeout=180.0)
    assert len(errors) == 2
    assert all("Timed out" in e for e in errors[:1]), errors  # the first waits for the silent peer: a timeout
    assert errors[1] != "no error", errors  # the second fails too (a timeout, or the pair closed by the first)


def run_job(
    strategy: str,
    out: Path,
    *,
    max_steps: int,
    every: int,
    timeout: float,
    fault: str | None = None,
    max_restarts: int = 3,
) -> dict[str, Any]:
    """One single-node torchrun job of 2 ranks of the worker (the elastic agent restarts it after a fault)."""
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.5", str(WORKER)]
    command += ["--strategy", strategy, "--max-steps", str(max_steps), "--every", str(every)]
    command += ["--out", str(out), "--timeout", str(timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    # Workers sharing the rendezvous store key their process group by the restart count, and a restarted group can
    # read the dead round's addresses (gloo "connectFullMesh ... Connection refused"; pytorch/pytorch#135712).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.pop(ENV_VAR, None)
    if fault:
        env[ENV_VAR] = fault
    log = out / "log.txt"
    with log.open("w") as stream:
        # A session of its own: a job past its time is killed with every rank (a stopped one included).
        agent = subprocess.Popen(
            command, stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        try:
            code = agent.wait(timeout=1500)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            code = agent.wait()
    attempts = out / "attempts.jsonl"
    return {
        "exit_code": code,
        "attempts": [json.loads(line) for line in attempts.read_text().splitlines()] if attempts.is_file() else [],
        "log_tail": log.read_text()[-1500:],
    }


def same_parameters(first: Path, second: Path, world: int = 2) -> bool | None:
    """Bitwise equality of every rank's final parameters (None when a run left none)."""
    for rank in range(world):
        a, b = first / f"final_rank{rank}.pt", second / f"final_rank{rank}.pt"
        if not (a.is_file() and b.is_file()):
            return None
        left, right = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        if left.keys() != right.keys() or not all(torch.equal(left[k], right[k]) for k in left):
            return False
    return True


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    ("scenario", "fault"), [("kill", "kill:rank=1:step=5"), ("save-kill", "save-kill:rank=1:step=8")]
)
def test_torchrun_job_survives_and_resumes_bit_identically(tmp_path, scenario, fault):
    options = {"max_steps": 10, "every": 4, "timeout": 120.0}
    reference = run_job("flexdemo", tmp_path / "reference", **options)
    assert reference["exit_code"] == 0, reference["log_tail"]
    job = run_job("flexdemo", tmp_path / scenario, fault=fault, **options)
    assert job["exit_code"] == 0, job["log_tail"]
    attempts = job["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1]
    assert attempts[1]["resumed_from"] == "step=000004.ckpt"  # save-kill: the step-8 save never completed
    assert same_parameters(tmp_path / scenario, tmp_path / "reference") is True


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(3600)
def test_torchrun_job_survives_a_stopped_peer(tmp_path):
    options = {"max_steps": 8, "every": 4}
    reference = run_job("flexdemo", tmp_path / "reference", timeout=10.0, **options)
    assert reference["exit_code"] == 0, reference["log_tail"]
    job = run_job("flexdemo", tmp_path / "hang", timeout=10.0, fault="stop:rank=1:step=6", **options)
    assert job["exit_code"] == 0, job["log_tail"]
    (error,) = (tmp_path / "hang").glob("error_rank0_attempt0.json")
    assert "timed out" in error.read_text().lower()
    assert same_parameters(tmp_path / "hang", tmp_path / "reference") is True


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("strategy", ["flexdemo", "matformer", "subspace", "sparseflip"])
def test_short_fits_exit_cleanly(tmp_path, strategy):
    """Two 2-rank fits in a row; torchrun's exit code is non-zero if a worker aborts at teardown (SIGABRT)."""
    for repeat in range(2):
        job = run_job(strategy, tmp_path / str(repeat), max_steps=2, every=0, timeout=120.0, max_restarts=0)
        assert job["exit_code"] == 0, job["log_tail"]
