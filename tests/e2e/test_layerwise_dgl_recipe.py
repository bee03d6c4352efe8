"""Smoke run of recipes/layerwise/bench_layerwise_dgl.py --quick: testbed runs of the plain pipeline and DGL, digits
accuracy.

Needs the bandwidth testbed (root, iproute2, network namespaces); skipped with the reason otherwise. Checks the JSON
the recipe writes (structure, exact DGL bytes per step), not its timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.testbed_support import require_testbed

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bench_layerwise_dgl_quick_smoke(tmp_path: Path) -> None:
    require_testbed()
    command = [
        sys.executable,
        str(REPO / "recipes/layerwise/bench_layerwise_dgl.py"),
        "--quick",
        "--out-dir",
        str(tmp_path),
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1450)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    runs = {(run["variant"], run["bandwidth"]): run for run in results["pipeline"]["runs"]}
    assert set(runs) == {("plain", "unthrottled"), ("plain", "80mbit"), ("dgl", "80mbit")}
    dgl, plain = runs[("dgl", "80mbit")], runs[("plain", "80mbit")]
    # DGL: one fp32 activation tensor per step (batch 8 x seq 32 x d 128), forward only; the header only on step 0
    assert dgl["pipeline_bytes_per_step"] == 8 * 32 * 128 * 4
    assert dgl["first_step_pipeline_bytes"] == 8 * 32 * 128 * 4 + 64
    assert plain["pipeline_bytes_per_step"] > 2 * dgl["pipeline_bytes_per_step"]  # forward + backward (+ loss)
    assert results["pipeline"]["operating_points"]["80mbit"]["R"] > 0
    digits = results["dgl"]["digits_cnn"]
    assert 0.0 <= digits["dgl_test_accuracy"] <= 1.0 and 0.0 <= digits["end_to_end_test_accuracy"] <= 1.0
