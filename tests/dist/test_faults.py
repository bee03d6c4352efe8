"""Faults on real process groups: a hung peer inside a later-created group fails within the job's timeout; and
(slow) torchrun jobs of recipes/reliability/reliability_worker.py that survive a killed rank, a hung peer and a crash
mid-save."""

from __future__ import annotations

import importlib.util
import time
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import pytest

from lightning_hetero.testing import run_distributed

REPO = Path(__file__).resolve().parents[2]


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


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_reliability", REPO / "recipes/reliability/bench_reliability.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    ("scenario", "fault"), [("kill", "kill:rank=1:step=5"), ("save-kill", "save-kill:rank=1:step=8")]
)
def test_torchrun_job_survives_and_resumes_bit_identically(tmp_path, scenario, fault):
    bench = _bench()
    options = {"nodes": 1, "ranks_per_node": 2, "max_steps": 10, "every": 4, "timeout": 120.0}
    reference = bench.run_job("flexdemo", tmp_path / "reference", **options)
    assert reference["exit_code"] == 0, reference["log_tail"]
    job = bench.run_job("flexdemo", tmp_path / scenario, fault=fault, **options)
    assert job["exit_code"] == 0, job["log_tail"]
    attempts = job["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1]
    assert attempts[1]["resumed_from"] == "step=000004.ckpt"  # save-kill: the step-8 save never completed
    assert bench.same_parameters(tmp_path / scenario, tmp_path / "reference", 2) is True


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(3600)
def test_torchrun_job_survives_a_stopped_peer(tmp_path):
    bench = _bench()
    options = {"nodes": 1, "ranks_per_node": 2, "max_steps": 8, "every": 4}
    reference = bench.run_job("flexdemo", tmp_path / "reference", timeout=10.0, **options)
    assert reference["exit_code"] == 0, reference["log_tail"]
    job = bench.run_job("flexdemo", tmp_path / "hang", timeout=10.0, fault="stop:rank=1:step=6", **options)
    assert job["exit_code"] == 0, job["log_tail"]
    (error,) = (tmp_path / "hang").glob("error_rank0_attempt0.json")
    assert "timed out" in error.read_text().lower()
    assert bench.same_parameters(tmp_path / "hang", tmp_path / "reference", 2) is True


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("strategy", ["flexdemo", "matformer", "subspace", "sparseflip"])
def test_short_fits_exit_cleanly(tmp_path, strategy):
    """Two 2-rank fits in a row; torchrun's exit code is non-zero if a worker aborts at teardown (SIGABRT)."""
    bench = _bench()
    for repeat in range(2):
        job = bench.run_job(
            strategy,
            tmp_path / str(repeat),
            nodes=1,
            ranks_per_node=2,
            max_steps=2,
            every=0,
            timeout=120.0,
            max_restarts=0,
        )
        assert job["exit_code"] == 0, job["log_tail"]
