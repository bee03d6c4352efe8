"""recipes/hetero/bench_hetero.py: argument checks, the best-baseline target, time to target and speed-up on fixed
records."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "recipes" / "hetero"))

hetero = importlib.import_module("bench_hetero")


def _record(side: str, seed: int, curve: list[tuple[float, float]], lr: float = 1e-3) -> dict:
    """A finished run whose evaluations at steps 10, 20, ... took ``(seconds, loss)``."""
    points = [[10 * (index + 1), seconds, loss] for index, (seconds, loss) in enumerate(curve)]
    return {
        "side": side,
        "seed": seed,
        "learning_rate": lr,
        "ok": True,
        "exit_code": 0,
        "nodes": [],
        "worker": {
            "val_losses": points,
            "final_val_loss": points[-1][2],
            "tiers": None,
            "micro_batch_sizes": None,
            "median_step_s": 0.1,
            "setup_seconds": 1.0,
        },
    }


def _failed(side: str, seed: int) -> dict:
    return {"side": side, "seed": seed, "learning_rate": 1e-3, "ok": False, "exit_code": 137, "nodes": [{"oom": 1}]}


def test_target_is_the_best_finished_baseline_and_speedup_is_its_time_over_ours():
    results = {
        "sides": {
            # DDP failed on every seed (the small node was OOM-killed): it cannot be the best baseline.
            "ddp": {"best_lr": None, "seeds": [_failed("ddp", 0)]},
            "single": {
                "best_lr": 1e-3,
                "seeds": [
                    _record("single", 0, [(10, 5.0), (20, 4.5), (30, 4.0)]),
                    _record("single", 1, [(10, 5.0), (20, 4.6), (30, 4.06)]),
                ],
            },
            "matformer-auto": {
                "best_lr": 2e-3,
                "seeds": [
                    _record("matformer-auto", 0, [(10, 4.5), (20, 4.0), (30, 3.9)]),
                    _record("matformer-auto", 1, [(10, 4.2), (20, 4.05), (30, 3.9)]),
                ],
            },
        }
    }
    analysis = hetero.analyse(results, margin=0.01)
    assert analysis["best_baseline"] == "single"
    assert analysis["target"] == pytest.approx(4.03 * 1.01)
    sides = analysis["sides"]
    assert sides["ddp"]["finished_seeds"] == 0 and sides["ddp"]["failures"][0]["exit_code"] == 137
    # single reaches 4.0703 at 30 s on both seeds; matformer at 20 s on both (4.0 and 4.05).
    assert sides["single"]["time_to_target_s"] == pytest.approx(30)
    assert sides["matformer-auto"]["time_to_target_s"] == pytest.approx(20)
    assert sides["matformer-auto"]["speedup_time_to_target"] == pytest.approx(1.5)
    assert sides["matformer-auto"]["val_loss_gap_pct"] == pytest.approx(100 * (3.9 / 4.03 - 1))


def test_a_side_that_misses_the_target_on_one_seed_has_no_time_to_target():
    results = {
        "sides": {
            "single": {
                "best_lr": 1e-3,
                "seeds": [_record("single", 0, [(10, 4.0)]), _record("single", 1, [(10, 4.0)])],
            },
            "flexdemo-share": {
                "best_lr": 1e-3,
                "seeds": [_record("flexdemo-share", 0, [(5, 3.9)]), _record("flexdemo-share", 1, [(5, 4.5)])],
            },
        }
    }
    sides = hetero.analyse(results, margin=0.01)["sides"]
    assert sides["flexdemo-share"]["seeds_reaching_target"] == 1
    assert sides["flexdemo-share"]["time_to_target_s"] is None
    assert sides["flexdemo-share"]["speedup_time_to_target"] is None


def test_no_finished_baseline_gives_no_target():
    results = {"sides": {"ddp": {"best_lr": None, "seeds": [_failed("ddp", 0)]}}}
    analysis = hetero.analyse(results, margin=0.01)
    assert analysis["best_baseline"] is None
    assert analysis["sides"]["ddp"]["final_val_loss_mean"] is None  # strict JSON: no NaN


def test_best_lr_ignores_failed_runs():
    runs = [_failed("ddp", 0), _record("ddp", 0, [(1, 4.0)], lr=2e-3), _record("ddp", 0, [(1, 3.5)], lr=3e-3)]
    assert hetero.best_lr(runs) == 3e-3
    assert hetero.best_lr([_failed("ddp", 0)]) is None


def test_smoke_arguments_and_unknown_sides(tmp_path):
    args = hetero.parse_args(["--scenario", "speed", "--smoke", "--out-dir", str(tmp_path)])
    assert (args.steps, args.lrs, args.seeds) == (8, [1e-3], [0])
    assert args.sides == hetero.SCENARIOS["speed"]["sides"]
    with pytest.raises(SystemExit):
        hetero.parse_args(["--scenario", "speed", "--sides", "dpp"])


def test_worker_command_carries_the_scenario_model_and_batch(tmp_path):
    args = hetero.parse_args(["--scenario", "memory", "--out-dir", str(tmp_path)])
    plan = hetero.side_plan("matformer-auto", args)
    assert plan == hetero.Plan(2000, 100, 100)  # no budget: --steps for every side
    argv = hetero.worker_argv(hetero.SIDES["matformer-auto"], 2e-3, 1, plan, args, tmp_path / "w.json")
    assert argv[argv.index("--tiers") + 1] == "auto"
    assert argv[argv.index("--batch-size") + 1] == "16"
    assert '"intermediate_size": 1024' in argv[argv.index("--model-config") + 1]
    args.small_node_memory = 123
    assert hetero.node_limits(args, 2) == ([1.0, 1.0], [None, 123])
    assert hetero.node_limits(args, 1) == ([1.0], [None])


def test_markdown_table_has_a_row_per_side_and_names_failures():
    results = {
        "sides": {
            "single": {"best_lr": 1e-3, "seeds": [_record("single", 0, [(10, 4.0)])]},
            "ddp": {"best_lr": None, "seeds": [_failed("ddp", 0)]},
        }
    }
    results["analysis"] = hetero.analyse(results, margin=0.01)
    table = hetero.markdown_table(results).splitlines()
    assert len(table) == 4
    assert table[2].startswith("| single | 0.001 | 4.0000 +- 0.0000 (1) | +0.00% |")
    assert table[3].startswith("| ddp | - | failed (exit 137) |")


def test_a_wall_clock_budget_gives_each_side_the_steps_its_measured_step_fills(tmp_path):
    args = hetero.parse_args(["--scenario", "speed", "--budget-seconds", "240", "--reuse", "--out-dir", str(tmp_path)])
    (tmp_path / "budget").mkdir()
    (tmp_path / "budget" / "single.json").write_text('{"median_step_s": 0.096, "exit_code": 0}')
    (tmp_path / "budget" / "ddp.json").write_text('{"median_step_s": 0.9, "exit_code": 0}')
    (tmp_path / "budget" / "flexdemo.json").write_text('{"median_step_s": null, "exit_code": 1}')
    assert hetero.side_plan("single", args) == hetero.Plan(2500, 100, 125)
    assert hetero.side_plan("ddp", args) == hetero.Plan(267, 26, 13)
    assert hetero.side_plan("flexdemo", args) == hetero.Plan(2000, 100, 100)  # its timing run failed: --steps


def test_headline_section_names_the_best_baseline_and_our_best_side(tmp_path):
    results = {
        "scenario": "speed",
        "nodes": {"A": {"cpu": 1.0, "memory_bytes": None}, "B": {"cpu": 0.5, "memory_bytes": None}},
        "bandwidth": "50mbit",
        "operating_point": {"R": 8.8},
        "seeds": [0],
        "steps": 2000,
        "budget_seconds": 240.0,
        "lrs": {"single": [1e-3], "flexdemo-share": [2e-3]},
        "metadata": {"git_revision": "abc"},
        "sides": {
            "single": {"best_lr": 1e-3, "seeds": [_record("single", 0, [(10, 4.0)])]},
            "flexdemo-share": {"best_lr": 2e-3, "seeds": [_record("flexdemo-share", 0, [(5, 3.9)])]},
        },
    }
    results["analysis"] = hetero.analyse(results, margin=0.01)
    path = tmp_path / "headline.json"
    hetero.write_headline(results, path)
    entry = json.loads(path.read_text())["hetero_speed"]
    assert (entry["baseline"], entry["ours"], entry["R"], entry["git_revision"]) == (
        "single",
        "flexdemo-share",
        8.8,
        "abc",
    )
    assert entry["baseline_final_val_loss_mean"] == 4.0 and entry["final_val_loss_mean"] == 3.9
    assert entry["speedup_time_to_target"] == pytest.approx(2.0) and entry["budget_seconds"] == 240.0
