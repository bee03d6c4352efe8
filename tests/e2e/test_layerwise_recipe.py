"""Smoke run of recipes/layerwise/bench_layerwise.py --quick: every experiment runs and lands in its JSON key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a 4-process run; on a busy shared machine it can take minutes
def test_quick_recipe_writes_every_section(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"dgl": {"kept": True}}))  # another recipe's section
    command = [
        sys.executable,
        str(REPO / "recipes" / "layerwise" / "bench_layerwise.py"),
        "--quick",
        "--out",
        str(tmp_path),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["dgl"] == {"kept": True}
    assert results["quick"] is True and results["git_revision"] and results["torch"]
    assert [row["model"] for row in results["end_to_end"]] == ["cnn", "vit", "llama"]
    assert [row["model"] for row in results["greedy"]] == ["cnn", "vit", "llama"]
    for row in results["greedy"]:
        assert len(row["stage_seconds"]) == row["blocks"] == len(row["per_stage_head"])
        assert row["cache"]["entries"] > 0
    assert {(row["model"], row["cached_base"]) for row in results["retrain_last_block"]} == {
        ("vit", True),
        ("vit", False),
        ("llama", True),
        ("llama", False),
    }
    assert 0.0 <= results["lowbit"]["greedy"]["accuracy"] <= 1.0
    assert (tmp_path / "results.png").stat().st_size > 0
