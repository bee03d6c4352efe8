"""recipes/flexdemo/bench_flexdemo_horizon.py: argument checks, the seed statistics and time to target, and one tiny
real run."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "recipes" / "flexdemo"))

horizon = importlib.import_module("bench_flexdemo_horizon")


def _run(seed: int, losses: list[float], every: int = 10) -> dict:
    return {
        "seed": seed,
        "val_losses": [[every * (index + 1), loss] for index, loss in enumerate(losses)],
        "tokens_per_step": 512,
        "train_tokens": 512 * every * len(losses),
    }


def _speed(step_s: float, wire: float) -> dict:
    return {"median_step_s": step_s, "wire_tx_bytes_per_step": wire, "wire_rx_bytes_per_step": wire}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "2000", "--val-every", "41"], "more than 2%"),
        (["--topology", "2x2", "--global-batch", "6"], "not divisible"),
        (["--knobs", "demo-1/16-sign@1e-3"], "drop the @lr"),
        (["--also", "demo-1/16-sign"], "give its learning rate"),
        (["--topology", "2x2", "--also", "ddp-b0.999@3e-3"], "baseline is hsdp"),
        (["--topology", "2x1", "--also", "hsdp@1e-3"], "baseline is ddp"),
        (["--flexdemo", "hsdp"], "stock baseline"),
        (["--knobs", "demo-1/7x"], "demo-1/7x"),
    ],
)
def test_bad_arguments_fail_before_any_run(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        horizon.parse_args(argv)
    assert message in capsys.readouterr().err


def test_same_global_batch_on_both_topologies() -> None:
    assert horizon.per_rank_batch(horizon.parse_args(["--topology", "2x2"])) == 1
    assert horizon.per_rank_batch(horizon.parse_args(["--topology", "2x1"])) == 2


def test_analysis_over_seeds() -> None:
    args = horizon.parse_args(["--topology", "2x2", "--bandwidth", "20mbit", "--target-margin", "0.01"])
    base = "hsdp@0.001"
    flex = "demo-1/32-sign@0.003"
    seeds = {
        base: [_run(0, [6.0, 5.0, 4.0]), _run(1, [6.0, 5.0, 4.2])],
        flex: [_run(0, [5.5, 4.1, 4.02]), _run(1, [5.5, 4.5, 4.1])],
    }
    tuning = {base: seeds[base][0], "hsdp@0.01": _run(0, [6, 5, 4.5]), flex: seeds[flex][0]}
    speed = {base: _speed(2.0, 5e6), flex: _speed(0.25, 6e4)}
    analysis = horizon.analyse(tuning, seeds, base, flex, speed, 0.05, args)
    target = 4.1 * 1.01
    assert analysis["target_val_loss"] == pytest.approx(target, abs=1e-4)
    assert analysis["baseline"]["final_val_loss_mean"] == pytest.approx(4.1)
    assert analysis["baseline"]["final_val_loss_std"] == pytest.approx(0.1414, abs=1e-4)
    # Gap per seed against the same seed's baseline; the headline gap compares the means.
    assert analysis["val_loss_gap_pct_per_seed"] == [pytest.approx(0.5), pytest.approx(-2.38, abs=0.01)]
    assert analysis["val_loss_gap_pct"] == pytest.approx(100 * (4.06 / 4.1 - 1), abs=0.01)
    # Steps to target: baseline seeds reach 4.141 at step 30 and never (4.2); flexdemo at 20 and 30.
    assert analysis["baseline"]["steps_to_target"] == [30, None]
    assert analysis["baseline"]["time_to_target_s_mean"] is None  # not every seed reached it
    assert analysis["speedup_time_to_target"] is None
    assert analysis["flexdemo"]["steps_to_target"] == [20, 30]
    assert analysis["flexdemo"]["time_to_target_s_mean"] == pytest.approx(6.2, abs=0.05)
    assert analysis["bytes_ratio"] == pytest.approx(83.3, abs=0.1)
    assert analysis["R"] == pytest.approx((5e6 * 8 / 20e6) / 0.05, rel=0.05)
    assert "hsdp@0.01" in analysis["tuning"]
    table = horizon.markdown_table({"analysis": analysis})
    assert "demo-1/32-sign@0.003" in table and "not every seed" in table


def test_pick_best_is_the_lowest_final_loss() -> None:
    runs = {"a": _run(0, [5.0, 4.0]), "b": _run(0, [5.0, 3.9]), "c": _run(0, [3.0, 4.5])}
    assert horizon.pick_best(runs, ["a", "b", "c"]) == "b"


@pytest.mark.timeout(600)
def test_tiny_sweep_end_to_end(tmp_path: Path) -> None:
    """Three runs on loopback (DDP, FlexDeMo with each AdamW exchange; 2 nodes x 1 rank, 4 steps): whole runs, the
    table, the plots."""
    out = tmp_path / "horizon"
    argv = ["--topology", "2x1", "--steps", "4", "--val-every", "1", "--val-batches", "1", "--lr-warmup", "1"]
    argv += ["--baseline-lrs", "1e-3", "--flexdemo", "demo-1/32-sign-xpre", "--flexdemo-lrs", "1e-3", "--knobs"]
    argv += ["--also", "demo-1/32-sign@1e-3", "--seeds", "0", "--no-speed"]
    horizon.main([*argv, "--out-dir", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert set(results["tuning"]) == {"ddp@0.001", "demo-1/32-sign-xpre@0.001", "demo-1/32-sign@1e-3"}
    for run in results["tuning"].values():
        assert [step for step, _ in run["val_losses"]] == [1, 2, 3, 4]
        assert run["train_tokens"] == 4 * 4 * 128 and run["exit_codes"][0] == 0
    flexdemo = [results["tuning"][name] for name in ("demo-1/32-sign-xpre@0.001", "demo-1/32-sign@1e-3")]
    assert flexdemo[0]["val_losses"] != flexdemo[1]["val_losses"]  # the exchange reached the optimizer
    best = min(flexdemo, key=lambda run: run["val_losses"][-1][1])["variant"]
    assert results["analysis"]["flexdemo"]["variant"] == best
    assert (out / "val_loss_vs_tokens.png").stat().st_size > 0 and (out / "tuning.png").stat().st_size > 0
    again = horizon.quality_run("ddp@0.001", 0, horizon.parse_args([*argv, "--out-dir", str(out), "--reuse"]))
    assert again["val_losses"] == results["tuning"]["ddp@0.001"]["val_losses"]  # reused, not rerun
