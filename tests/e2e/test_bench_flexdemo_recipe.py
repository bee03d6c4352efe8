"""Smoke run of recipes/flexdemo/bench_flexdemo.py on the testbed: tiny model, 4 steps, the sweep's code paths end
to end.

A stock DDP baseline, a DeMo variant with a non-default chunk and error feedback off, and a DiLoCo variant with its
own H and outer lr: quality runs unthrottled, then the extra bandwidth for the baseline, the default and the best.
Needs the bandwidth testbed (root, iproute2); skipped with the reason otherwise. Checks the JSON the recipe writes
(structure, which runs happened, DiLoCo costed over a whole period), not its timings or losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.testbed_support import require_testbed

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.heavy  # a minute or more; out of the default run to keep it near 20 min (-m heavy)
@pytest.mark.timeout(1800)
def test_bench_flexdemo_sweep_smoke(tmp_path: Path) -> None:
    require_testbed()
    variants = ["ddp", "demo-1/32-sign-c32-noef@1e-3", "diloco-h2-olr0.7"]
    command = [sys.executable, str(REPO / "recipes/flexdemo/bench_flexdemo.py"), "--preset", "llama-tiny"]
    command += ["--ranks-per-node", "1", "--batch-size", "1", "--steps", "4", "--val-every", "2", "--val-batches", "1"]
    command += ["--variants", *variants, "--bandwidths", "unthrottled", "--extra-bandwidths", "100mbit"]
    command += ["--speed-steps", "3", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1750)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    analysis = results["analysis"]
    assert set(results["quality"]) == set(variants)
    assert results["compute_only"]["processes"] == 2  # one per testbed rank, run together
    assert analysis["baseline"] == "ddp" and analysis["default"] == "demo-1/32-sign-c32-noef@1e-3"
    assert analysis["best"] in variants[1:] and analysis["best_at"] in ("unthrottled", "100mbit")
    quality = results["quality"]["demo-1/32-sign-c32-noef@1e-3"]
    assert quality["error_feedback"] is False and quality["replicator_options"] == {"values": "sign", "chunk": 32}
    assert [step for step, _ in quality["val_losses"]] == [2, 4]
    assert quality["median_codec_s"] > 0 and quality["median_wait_s"] >= 0  # the replicator's compute, per step
    assert results["quality"]["ddp"]["median_codec_s"] is None  # stock DDP has no codec
    default_100 = analysis["variants"]["demo-1/32-sign-c32-noef@1e-3"]["100mbit"]
    assert default_100["codec_s"] > 0 and default_100["step_over_compute_codec_or_link"] > 0
    # the extra bandwidth is measured for the baseline, the default and the best only
    measured = {name for name, per_bandwidth in results["speed"].items() if "100mbit" in per_bandwidth}
    assert measured == {"ddp", "demo-1/32-sign-c32-noef", analysis["best"].partition("@")[0]}
    # DiLoCo (H = 2) is costed by its means over the measured steps, which include a synchronising step
    diloco = results["quality"]["diloco-h2-olr0.7"]
    assert diloco["replicator_options"] == {"sync_every": 2, "outer_lr": 0.7}
    assert analysis["variants"]["diloco-h2-olr0.7"]["unthrottled"]["wire_bytes_per_step"] > 0
    for name in ("frontier.png", "loss_vs_wallclock.png", "bytes_per_step.png"):
        assert (tmp_path / name).stat().st_size > 0
    table = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes/flexdemo/bench_flexdemo.py"),
            "--markdown",
            str(tmp_path / "results.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert table.returncode == 0 and "(baseline)" in table.stdout and "(default" in table.stdout
