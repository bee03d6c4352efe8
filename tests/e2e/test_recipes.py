"""Slow end-to-end runs of the shipped configs through the real console script (loss must go down)."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REPORT = re.compile(
    r"\[ValidationReport\] (before|after) training(?: \(from checkpoint\))?:\s+loss ([\d.]+), perplexity ([\d.]+)"
)


def run_cli(tmp_path: Path, config: str, *overrides: str, timeout: int = 900) -> tuple[str, Path, float]:
    executable = shutil.which("lightning-hetero")
    command = [executable] if executable else [sys.executable, "-m", "lightning_hetero"]
    out = tmp_path / "run"
    args = ["fit", "--config", str(REPO / config), "--trainer.default_root_dir", str(out)]
    args += ["--trainer.logger.init_args.save_dir", str(out), *overrides]
    start = time.perf_counter()
    result = subprocess.run(
        command + args,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    elapsed = time.perf_counter() - start
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    return log, out, elapsed


def reported_perplexities(log: str) -> dict[str, float]:
    return {phase: float(ppl) for phase, _, ppl in REPORT.findall(log)}


@pytest.mark.slow
@pytest.mark.heavy  # the README demo's full 600 steps (~80 s); tests/cli runs its console script for 5 steps
@pytest.mark.assets
@pytest.mark.timeout(900)
def test_quickstart_full_run_learns(tmp_path):
    log, out, elapsed = run_cli(tmp_path, "configs/quickstart.yaml")
    (metrics_file,) = out.rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    perplexities = [float(row["val/perplexity"]) for row in rows if row.get("val/perplexity")]
    assert losses[-1] < 0.75 * losses[0], losses
    assert perplexities == sorted(perplexities, reverse=True), perplexities
    report = reported_perplexities(log)
    assert report["after"] < 0.5 * report["before"], report
    print(f"quickstart: {elapsed:.0f} s, train loss {losses[0]:.2f} -> {losses[-1]:.2f}, val ppl {report}")


@pytest.mark.slow
@pytest.mark.assets
@pytest.mark.timeout(900)
def test_finetune_smollm2_prints_perplexity_before_and_after(tmp_path):
    pytest.importorskip("gguf", reason="GGUF loading needs `pip install gguf accelerate`")
    log, _, elapsed = run_cli(tmp_path, "configs/finetune_smollm2.yaml", "--trainer.max_steps", "10")
    report = reported_perplexities(log)
    assert set(report) == {"before", "after"}, log[-3000:]
    assert report["after"] < report["before"], report
    print(f"finetune_smollm2 (10 steps): {elapsed:.0f} s, val perplexity {report}")


@pytest.mark.timeout(600)
def test_bench_lowbit_quick_smoke(tmp_path):
    """The low-bit benchmark runs end to end in its quick mode and writes a complete JSON (figures not checked)."""
    import json

    command = [sys.executable, str(REPO / "recipes/sparseflip/bench_lowbit.py"), "--quick", "--out", str(tmp_path)]
    command += ["--only", "classifiers", "sweep", "bytes", "packing"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["classifiers"]) == 8 and len(results["sweep"]) == 6 and len(results["bytes"]) == 4
    assert results["packing"]["packed_equals_float"] is True
    assert all(row["accuracy"] == row["accuracy"] for row in results["sweep"])  # no NaN
