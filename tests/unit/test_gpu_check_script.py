"""scripts/gpu_check.sh without a GPU: its CPU dry run writes the JSON files the device tool brings back, a spent
budget skips steps with a reason, and the FlexDeMo step-time script refuses a GPU it does not have."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
STEPS = ("env", "unit_cuda", "dist_cuda", "bench_codec", "flexdemo_steps")
# What the device tool brings back from $OUT: at most 8 files named in letters, digits, '.', '_' and '-'.
RETURNABLE = re.compile(r"^[A-Za-z0-9._-]+$")


def _run_check(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _load(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dry_run_writes_one_returnable_json_per_step_and_a_summary(tmp_path: Path) -> None:
    completed = _run_check(tmp_path, GPU_CHECK_DRY_RUN="1")
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == sorted([*(f"{step}.json" for step in STEPS), "summary.json", "gpu_check.log"])
    assert len(files) <= 8 and all(RETURNABLE.match(name) for name in files)
    assert all(path.is_file() for path in tmp_path.iterdir())  # no folders: nothing too deep to come back

    for step in STEPS:
        record = _load(tmp_path, step)
        assert record["step"] == step and record["status"] == "passed" and record["rc"] == 0
        assert record["seconds"] >= 0 and record["timeout_s"] > 0 and isinstance(record["output_tail"], list)
    env = _load(tmp_path, "env")["result"]
    assert env["torch"] == torch.__version__ and env["cuda_available"] == torch.cuda.is_available()
    assert env["lightning_hetero_imported_from"].startswith(str(REPO))
    unit = _load(tmp_path, "unit_cuda")["pytest"]  # pytest's last line parsed
    assert "failed" not in unit and "errors" not in unit
    ran = "passed" if torch.cuda.is_available() else "skipped"  # the cuda cases skip without a GPU
    assert unit[ran] > 0 and unit["deselected"] > 0
    assert _load(tmp_path, "dist_cuda")["pytest"]["passed"] == 1  # the NCCL guard refuses before spawning
    codec = _load(tmp_path, "bench_codec")["result"]
    assert codec["device"] == "cpu" and codec["codec_seconds_per_step"] > 0 and codec["wire_bytes_per_step"] > 0
    steps = _load(tmp_path, "flexdemo_steps")["result"]
    assert steps["errors"] == {} and set(steps["runs"]) == {"single", "flexdemo"}
    assert steps["runs"]["flexdemo"]["backend"] == "gloo" and steps["runs"]["flexdemo"]["steps"] == 2
    assert steps["runs"]["flexdemo"]["median_codec_s"] is not None  # the replicator ran every step

    summary = _load(tmp_path, "summary")
    assert summary["dry_run"] is True and summary["all_passed"] is True
    assert list(summary["steps"]) == list(STEPS)
    assert summary["steps"]["unit_cuda"]["pytest"] == unit


def test_a_spent_budget_skips_every_step_with_its_reason_and_fails(tmp_path: Path) -> None:
    completed = _run_check(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_BUDGET_S="0")
    assert completed.returncode == 1, completed.stderr[-3000:]
    summary = _load(tmp_path, "summary")
    assert summary["all_passed"] is False and list(summary["steps"]) == list(STEPS)
    for step in STEPS:
        record = _load(tmp_path, step)
        assert record["status"] == "skipped" and "budget spent" in record["skip_reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_step_time_script_refuses_a_gpu_it_does_not_have(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_flexdemo_steps.py"), "--accelerator", "gpu"]
        + ["--out", str(tmp_path / "x.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2
    assert "--accelerator gpu: CUDA is not available here; use --accelerator cpu" in completed.stderr
    assert not (tmp_path / "x.json").exists()
