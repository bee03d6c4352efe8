"""The lighthouse is killed and restarted on the same address 10 s later, under 2 live replica groups
(recipes/spot/spot_lighthouse_restart.py: ``torchft_lighthouse`` and recipes/spot/spot_worker.py processes, gloo on
CPU).

The replicas wait (quorum attempts of 5 s fail and are asked again, ``FaultToleranceSettings.wait_for_replicas_s``),
find the restarted lighthouse, and train on: no process restarted, no committed step lost, both identical at the end.
The 60 s outage is measured by the recipe itself (docs/spot.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_lighthouse_restarted_on_the_same_address_loses_nothing(tmp_path):
    command = [sys.executable, str(REPO / "recipes" / "spot" / "spot_lighthouse_restart.py"), "--outage", "10"]
    command += ["--quorum-timeout", "5", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=380)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["survivor_restarts"] == 0 and result["steps_lost"] == 0, result
    assert result["identical_at_end"] and result["steps_after"] >= 5, result
    assert result["stall_s"] >= result["outage_s"] - 1, result  # they did wait through the outage
    log = (tmp_path / "worker_0.log").read_text()
    assert (
        "waiting for the lighthouse" in log and "Cancelled" not in log.split("waiting for the lighthouse", 1)[1][:200]
    )
