"""recipes/hetero/bench_hetero.py end to end, tiny: two sides on cgroup-limited testbed nodes (root, iproute2, cgroups).

The figures are not checked (recorded runs live in docs/results/hetero_*); what is checked is that each side trains
on nodes whose limits the testbed report confirms, that the batch share splits the global batch, and that the
results carry the fields the docs, the plot and the headline read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hetero.testbed.checks import TestbedConfigError, check_environment
from tests.testbed_support import require_testbed

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_speed_smoke_trains_alone_and_with_a_batch_share(tmp_path):
    require_testbed(probe_namespaces=True)
    try:
        check_environment(cgroup_controllers=("cpu", "memory"))
    except TestbedConfigError as error:
        pytest.skip(str(error))
    argv = [
        sys.executable,
        "recipes/hetero/bench_hetero.py",
        "--scenario",
        "speed",
        "--smoke",
        "--out-dir",
        str(tmp_path),
    ]
    argv += ["--sides", "single", "flexdemo-share", "--bandwidth", "50mbit"]
    completed = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=380)
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["nodes"] == {"A": {"cpu": 1.0, "memory_bytes": None}, "B": {"cpu": 0.5, "memory_bytes": None}}
    share = results["sides"]["flexdemo-share"]["seeds"][0]
    assert share["ok"] and sum(share["worker"]["micro_batch_sizes"]) == 2 * 8  # the global batch, split by speed
    assert [node["cpu_quota"] for node in share["nodes"]] == [1.0, 0.5]  # what the kernel was told
    assert results["analysis"]["best_baseline"] == "single"
    assert set(results["analysis"]["sides"]) == {"single", "flexdemo-share"}
    assert (tmp_path / "val_loss_vs_wallclock.png").stat().st_size > 0
    table = subprocess.run([*argv, "--markdown"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    assert "| flexdemo-share |" in table
