"""Smoke runs of the benchmark recipes that had none: each runs end to end in a tiny setting and writes its JSON.

The figures themselves are not checked (they are recorded runs, see docs/benchmarks.md); what is checked is that
the recipe runs, that its results file carries the fields the docs and the headline read, and the few facts that
hold exactly whatever the machine (byte ratios of the codecs, R computed from the stored runs). The testbed recipes
need root and iproute2 and skip cleanly without them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.testbed_support import require_testbed

REPO = Path(__file__).resolve().parents[2]


def run_recipe(*argv: str, timeout: int = 280) -> str:
    result = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_subspace_quick_run_and_recompute(tmp_path):
    """2 stages, plain vs ssn16-bf16, 4 steps unthrottled and at 80 Mbit; then ``--from-results`` gives the same."""
    require_testbed()
    out = tmp_path / "subspace"
    run_recipe(
        "recipes/subspace_pipeline/bench_subspace.py", "--stages", "2", "--variants", "plain", "ssn16-bf16",
        "--bandwidths", "unthrottled", "80mbit", "--steps", "4", "--speed-steps", "4", "--warmup", "1",
        "--val-every", "2", "--val-batches", "1", "--batch-size", "4", "--microbatches", "2", "--out-dir", str(out),
    )  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert {"git_revision", "torch", "machine", "seeds"} <= set(results["meta"])
    runs = {(run["variant"], run["bandwidth"]): run for run in results["runs"]}
    assert set(runs) == {(v, b) for v in ("plain", "ssn16-bf16") for b in ("unthrottled", "80mbit")}
    # bf16 coordinates of a d/16-dimensional subspace: 1/32 of the fp32 activations, plus a few header bytes.
    reduction = runs["ssn16-bf16", "unthrottled"]["bytes_reduction_vs_plain"]
    assert 31.0 < reduction <= 32.0, reduction
    assert [step for step, _ in runs["plain", "unthrottled"]["val_losses"]] == [2, 4]
    assert all(math.isfinite(loss) for run in runs.values() for loss in run["train_losses"])
    point = results["operating_point"]["80mbit"]
    # Every field is rounded to 4 decimals: R must lie between the ratios of the rounding intervals' ends.
    half = 5e-5
    low, high = (
        (point["link_s"] - half) / (point["compute_s"] + half),
        (point["link_s"] + half) / (point["compute_s"] - half),
    )
    assert low - half <= point["ratio"] <= high + half, (point, low, high)
    assert runs["ssn16-bf16", "80mbit"]["step_over_physical_limit"] > 0
    before = {key: run.get("speedup_vs_plain") for key, run in runs.items()}
    run_recipe("recipes/subspace_pipeline/bench_subspace.py", "--from-results", str(out / "results.json"))
    again = json.loads((out / "results.json").read_text())
    assert {(r["variant"], r["bandwidth"]): r.get("speedup_vs_plain") for r in again["runs"]} == before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_baselines_quick_ddp_run(tmp_path):
    """Stock DDP on 2 testbed nodes, 3 steps unthrottled: step time, wire bytes and the compute-only run recorded."""
    require_testbed()
    out = tmp_path / "baselines"
    run_recipe(
        "recipes/flexdemo/bench_baselines.py", "--strategies", "ddp", "--bandwidths", "unthrottled", "--steps", "3",
        "--warmup", "1", "--out-dir", str(out),
    )  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    (run,) = results["runs"]
    assert run["strategy"] == "ddp" and run["median_step_s"] > 0
    assert run["wire_tx_bytes_per_step"] > 0  # the gradients crossed the veth link
    assert results["compute_only"]["median_step_s"] > 0


@pytest.mark.timeout(300)
def test_bench_operating_point_one_model(tmp_path):
    """R of llama-tiny at two bandwidths from one timed step, with the labelled 1B/8B projections."""
    run_recipe(
        "recipes/flexdemo/bench_operating_point.py", "--models", "llama-tiny", "--steps", "1",
        "--bandwidths", "20mbit", "1gbit", "--out-dir", str(tmp_path),
    )  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())
    (row,) = results["measured"]
    assert row["model"] == "llama-tiny" and row["compute_s"] > 0
    # R scales with 1 / bandwidth: the same bytes and compute at 50x the rate (R is stored to 2 decimals).
    assert row["R"]["20mbit"] > 0 and abs(row["R"]["20mbit"] / 50 - row["R"]["1gbit"]) <= 0.006
    assert {p["device"].split(" ")[0] for p in results["projected"]} == {"this", "H100"}
    assert "git_revision" in results["meta"]


def test_bench_operating_point_rejects_an_unknown_model():
    result = subprocess.run(
        [sys.executable, "recipes/flexdemo/bench_operating_point.py", "--models", "llama-huge"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0 and "--models" in result.stderr and "llama-tiny" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_matformer_memory_two_tiers(tmp_path):
    """Peak memory of tier 0 and tier 1 of llama-tiny, each measured in its own process."""
    out = tmp_path / "memory.json"
    run_recipe(
        "recipes/matformer/bench_matformer_memory.py", "--models", "llama-tiny", "--tiers", "0", "1", "--out", str(out)
    )
    (measured,) = json.loads(out.read_text())["measured"]
    tier0, tier1 = measured["rows"]
    assert (tier0["tier"], tier1["tier"]) == (0, 1) and tier1["intermediate_size"] * 2 == tier0["intermediate_size"]
    # The training state (weights, grads, AdamW moments) shrinks exactly by the dropped FFN half.
    assert math.isclose(tier1["state_saving_over_analytic"], 1.0, rel_tol=1e-3)
    assert tier1["peak_rss_growth_bytes"] > 0


@pytest.mark.timeout(120)
def test_bench_codec_times_every_phase_of_the_demo_codec(tmp_path):
    """llama-tiny shapes, one repeat: every phase is timed and the wire bytes are the replicator's payload formula."""
    out = tmp_path / "codec.json"
    run_recipe("recipes/flexdemo/bench_codec.py", "--preset", "llama-tiny", "--repeats", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"dct", "top_k", "inverse_dct", "encode", "decode_gathered", "clone_only"}
    assert all(value > 0 for value in result["seconds"].values()) and result["codec_seconds_per_step"] > 0
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_hetero.models import build_config
    from lightning_hetero.replication import build_replicator

    with torch.device("meta"):
        shapes = [p.shape for p in AutoModelForCausalLM.from_config(build_config("llama-tiny")).parameters()]
    assert result["parameters"] == sum(math.prod(shape) for shape in shapes)
    assert result["wire_bytes_per_step"] == build_replicator("demo", 1 / 32, values="sign").payload_bytes(shapes)
