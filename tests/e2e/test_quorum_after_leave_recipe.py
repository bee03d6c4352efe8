"""recipes/spot/quorum_after_leave.py end to end: after the first member left, the next quorum forms with the second
alone, and the JSON reports the wait (its value is a measurement for docs/spot.md, not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "spot" / "quorum_after_leave.py"


@pytest.mark.timeout(120)
def test_the_next_quorum_forms_without_the_member_that_left():
    command = [sys.executable, str(RECIPE), "--heartbeat-timeout-ms", "500"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=90, check=True)
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["next_quorum_members"] == ["second:0"] and result["heartbeat_timeout_ms"] == 500
    assert result["next_quorum_after_s"] > 0
