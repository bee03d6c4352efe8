"""The spot recipe end to end on a tiny schedule (``python recipes/spot/spot_recipe.py --smoke``): 3 Lightning FlexDeMo
Trainers (llama-tiny on ShakespeareDataModule, one shard each, cluster secret, no pickle) under docs/spot.md's
lighthouse command; two kills, a freeze past the quorum timeout, a lighthouse restart, two nodes killed together
below ``min_replicas``; and one node alone alongside. Checks the report's verdicts, not its timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.heavy  # ~160 s: out of the default run (python3 -m pytest -m heavy); its logic is unit-tested
@pytest.mark.timeout(900)
def test_the_smoke_schedule_survives_every_fault_with_nothing_lost(tmp_path):
    out = tmp_path / "spot.json"
    command = [sys.executable, str(REPO / "recipes" / "spot" / "spot_recipe.py"), "--smoke", "--out", str(out)]
    done = subprocess.run(
        [*command, "--work", str(tmp_path / "work")], capture_output=True, text=True, cwd=REPO, timeout=880
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["lightning"] and result["ranks_per_node"] == 1 and result["cluster_secret"]
    assert (result["kills"], result["sigstops"], result["lighthouse_restarts"], result["rejoins"]) == (4, 1, 1, 5)
    assert result["survivor_restarts"] == 0 and result["survivor_steps_lost"] == 0, result
    assert result["rejoined_bit_identical"] and result["rejoined_global_step_is_committed_step"], result["faults"]
    assert result["final_replicas_identical"], result
    assert result["distinct_node_batches"] and result["steps_with_two_or_more_nodes"] > 0, result
    assert result["below_min_waiting_log_lines"] >= 1, result  # node 0 said it was waiting, and went on
    assert result["below_min_wait_s"] >= 12, result
    assert "--join_timeout_ms 500 --heartbeat_timeout_ms 1500" in result["lighthouse_command"]
    for name in ("val_loss", "val_loss_one_node", "val_loss_vs_one_node_pct"):
        assert isinstance(result[name], float), (name, result[name])
