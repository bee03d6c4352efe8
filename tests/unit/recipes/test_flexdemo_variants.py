"""The variant grammar of recipes/flexdemo/bench_flexdemo.py (recipes/flexdemo/flexdemo_variants.py) and the sweep's
analysis."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "recipes" / name) for name in ("flexdemo", "common")]

variants = importlib.import_module("flexdemo_variants")
bench = importlib.import_module("bench_flexdemo")

# What worker_args returned for the old names before the grammar existed (recipes/bench_flexdemo.py at 0c49f5b).
OLD_NAMES = {
    "ddp": ["--strategy", "ddp"],
    "hsdp@1e-3": ["--strategy", "hsdp", "--learning-rate", "0.001"],
    "demo-1/32-bf16": [
        "--strategy",
        "flexdemo",
        "--replicator",
        "demo",
        "--kept-fraction",
        str(1 / 32),
        "--values",
        "bf16",
    ],
    "random-1/64-sign@3e-3": [
        *["--strategy", "flexdemo", "--replicator", "random", "--kept-fraction", str(1 / 64), "--values", "sign"],
        *["--learning-rate", "0.003"],
    ],
    "diloco": ["--strategy", "flexdemo", "--replicator", "diloco", "--kept-fraction", str(1 / 32)],
}


@pytest.mark.parametrize("name", sorted(OLD_NAMES))
def test_old_names_keep_their_worker_arguments(name):
    assert bench.worker_args(name) == OLD_NAMES[name]


def test_every_old_default_variant_still_parses():
    for name in bench.all_variants():
        variants.validate_variant(name)


def test_sweep_dimensions_reach_the_worker():
    args = bench.worker_args("demo-1/16-sign-c128-noef@3e-4")
    assert args == [
        *["--strategy", "flexdemo", "--replicator", "demo", "--kept-fraction", str(1 / 16), "--values", "sign"],
        *["--chunk", "128", "--no-error-feedback", "--learning-rate", "0.0003"],
    ]
    diloco = variants.parse_variant("diloco-h16-olr0.5-om0.8-bf16")
    assert diloco.replicator_options() == {"values": "bf16", "sync_every": 16, "outer_lr": 0.5, "outer_momentum": 0.8}
    assert diloco.periodic and diloco.period == 16 and diloco.speed_key == "diloco-h16-olr0.5-om0.8-bf16"
    assert variants.parse_variant("diloco").period == 32 and variants.parse_variant("diloco-1/8").period == 8
    both = variants.parse_variant("diloco-h8-demo1/32-c32-bf16@1e-3")  # DeMo + DiLoCo
    assert both.replicator_options() == {
        "values": "bf16",
        "outer_chunk": 32,
        "sync_every": 8,
        "outer_kept_fraction": 1 / 32,
    }
    assert both.period == 8 and both.learning_rate == 1e-3
    assert both.worker_args()[-6:] == [
        "--sync-every",
        "8",
        "--outer-kept-fraction",
        str(1 / 32),
        "--learning-rate",
        "0.001",
    ]
    assert variants.validate_variant("diloco-h8-demo1/32").replicator_options()["outer_kept_fraction"] == 1 / 32
    assert variants.parse_variant("demo-1/32-sign@1e-3").speed_key == "demo-1/32-sign"
    assert bench.worker_args("demo-1/32-sign-xgrad")[-2:] == ["--adamw-exchange", "gradient"]
    assert bench.worker_args("demo-1/32-sign-xpre")[-2:] == ["--adamw-exchange", "preconditioned"]
    assert not variants.parse_variant("demo-1/32-sign").periodic
    # AdamW's beta2, the one option the stock baselines take too (tuned alike on both sides).
    assert variants.parse_variant("ddp-b0.999@3e-3").worker_args() == [
        "--strategy", "ddp", "--learning-rate", "0.003", "--beta2", "0.999",
    ]  # fmt: skip
    assert variants.parse_variant("demo-1/32-sign-xpre-b.99").worker_args()[-2:] == ["--beta2", "0.99"]
    assert variants.parse_variant("hsdp").beta2 is None


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("demo-1/32-bf17", "unknown option 'bf17'"),
        ("demox-1/32", "unknown strategy or replicator 'demox'"),
        ("random-1/32-c32", "'c32' sets the chunk size, which only demo/topk/diloco take"),
        ("diloco-noef", "only demo/topk/random/striding take"),
        ("demo-h16", "only diloco take"),
        ("demo-olr0.7", "only diloco take"),
        ("demo+diloco", "write DeMo + DiLoCo as one DiLoCo variant"),
        ("demo-1/32-diloco", "demo and diloco cannot be combined"),
        ("demo-demo1/32", "only diloco take"),
        ("diloco-c32", "DiLoCo takes c<chunk> only with demo1/N"),
        ("demo-1/32-1/16", "kept_fraction given twice"),
        ("diloco-h16-1/32", "give DiLoCo's period once"),
        ("full-1/32", "'full' sends everything"),
        ("ddp-sign", "takes only AdamW's beta2"),
        ("hsdp-b0.999-b0.95", "takes only AdamW's beta2"),
        ("ddp-b1.5", "takes only AdamW's beta2"),
        ("demo-1/32-b0", "unknown option 'b0'"),
        ("demo-1/32-b.999-b0.99", "beta2 given twice"),
        ("demo-sgd-xgrad", "xgrad/xpre set how AdamW is exchanged"),
        ("demo-1/32@fast", "must be a learning rate"),
        ("demo-1/32@-1e-3", "must be > 0"),
        ("demo-1/0", "must be 1/N with N >= 1"),
    ],
)
def test_bad_names_are_refused_with_the_token_and_the_fix(name, message):
    with pytest.raises(ValueError, match="variant") as raised:
        variants.parse_variant(name)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("name", "message"), [("demo-c512", "chunk must be an integer in [1, 256]"), ("diloco-h0", "sync_every")]
)
def test_out_of_range_options_fail_at_validation(name, message):
    variants.parse_variant(name)  # the grammar accepts it; the replicator's own check refuses it
    with pytest.raises(ValueError, match=r"variant .*") as raised:
        variants.validate_variant(name)
    assert message in str(raised.value)


def test_the_script_refuses_a_bad_name_before_any_run(tmp_path, monkeypatch, capsys):
    argv = ["bench_flexdemo.py", "--out-dir", str(tmp_path / "out"), "--variants", "ddp", "demo-1/32-signn"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2
    assert "unknown option 'signn'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


def test_no_error_feedback_sends_the_same_payload_and_keeps_nothing():
    torch.manual_seed(0)
    source = torch.randn(128, 96)
    with_feedback = variants.build_variant_replicator(variants.parse_variant("demo-1/32-sign"))
    without = variants.build_variant_replicator(variants.parse_variant("demo-1/32-sign-noef"))
    kept, dropped = source.clone(), source.clone()
    piece_kept, piece_dropped = with_feedback.encode(0, kept), without.encode(0, dropped)
    assert torch.equal(piece_kept.wire, piece_dropped.wire)
    assert without.payload_bytes([source.shape]) == with_feedback.payload_bytes([source.shape])
    assert kept.abs().sum() > 0  # error feedback: the unsent remainder stays for the next step
    assert torch.count_nonzero(dropped) == 0
    assert type(without).__name__ == "NoErrorFeedbackDeMoReplicator" and isinstance(without, type(with_feedback))


def _run(losses, median_s, wire, mean_s=None, mean_wire=None):
    run = {"val_losses": losses, "median_step_s": median_s, "wire_tx_bytes_per_step": wire}
    run |= {"wire_rx_bytes_per_step": wire, "mean_step_s": mean_s, "wire_tx_bytes_per_step_mean": mean_wire}
    return run | {"wire_rx_bytes_per_step_mean": mean_wire}


def test_analysis_averages_diloco_over_its_period_and_picks_default_and_best():
    quality = {
        "ddp@3e-3": _run([(10, 7.0), (20, 6.0)], 1.0, 1000),
        "demo-1/32-sign@1e-3": _run([(10, 7.5), (20, 6.1)], 1.0, 1000),
        "demo-1/16-sign@1e-3": _run([(10, 6.0), (20, 6.05)], 1.0, 1000),
        "diloco-h16": _run([(10, 6.5), (20, 6.0)], 1.0, 1000),
    }
    speed = {
        "ddp": {"100mbit": _run([], 10.0, 100_000)},
        "demo-1/32-sign": {"100mbit": _run([], 2.0, 1_000)},
        "demo-1/16-sign": {"100mbit": _run([], 2.5, 2_000)},
        # median: an inner step without communication; mean over one period: what a step really costs
        "diloco-h16": {"100mbit": _run([], 0.5, 0, mean_s=1.0, mean_wire=10_000)},
    }
    analysis = bench.analyse(quality, speed, margin=0.02, compute_s=0.5)
    rows = analysis["variants"]
    assert analysis["baseline"] == "ddp@3e-3" and analysis["target_val_loss"] == pytest.approx(6.12)
    assert analysis["default"] == "demo-1/32-sign@1e-3"  # the first FlexDeMo variant unless named
    assert rows["diloco-h16"]["100mbit"]["step_s"] == 1.0
    assert rows["diloco-h16"]["100mbit"]["bytes_reduction_vs_baseline"] == 10.0
    # to target: ddp 20 x 10 s; demo 1/16 reaches it at step 10 (25 s); diloco at 20 (20 s); demo 1/32 at 20 (40 s)
    assert rows["demo-1/16-sign@1e-3"]["100mbit"]["speedup_to_target"] == 8.0
    assert rows["diloco-h16"]["100mbit"]["speedup_to_target"] == 10.0
    assert analysis["best"] == "diloco-h16" and analysis["best_at"] == "100mbit"
    assert analysis["best_loss"] == "diloco-h16"
    assert analysis["operating_point"]["100mbit"]["ratio"] == pytest.approx(100_000 * 8 / 1e8 / 0.5, rel=1e-3)
    named = bench.analyse(quality, speed, margin=0.02, compute_s=0.5, default_variant="demo-1/16-sign@1e-3")
    assert named["default"] == "demo-1/16-sign@1e-3"


def test_codec_time_counts_as_compute_in_the_hiding_ratio():
    quality = {"ddp": _run([(10, 6.0)], 1.0, 1000), "demo-1/32-sign": _run([(10, 6.1)], 0.5, 10)}
    demo = _run([], 2.0, 1_250_000) | {"median_codec_s": 1.0}  # 1.25 MB = 0.1 s at 100 Mbit
    speed = {"ddp": {"100mbit": _run([], 9.0, 100_000_000)}, "demo-1/32-sign": {"100mbit": demo}}
    cell = bench.analyse(quality, speed, margin=0.02, compute_s=0.5)["variants"]["demo-1/32-sign"]["100mbit"]
    assert cell["step_over_physical_limit"] == 4.0  # 2 s against max(0.5 s compute, 0.1 s link)
    assert cell["codec_s"] == 1.0 and cell["step_over_compute_codec_or_link"] == pytest.approx(1.33)
    baseline = bench.analyse(quality, speed, margin=0.02, compute_s=0.5)["variants"]["ddp"]["100mbit"]
    assert "codec_s" not in baseline and "step_over_compute_codec_or_link" not in baseline  # not recorded


def test_speed_runs_of_diloco_cover_a_whole_period():
    args = type("Args", (), {"speed_steps": 8, "slow_link_speed_steps": 5})()
    assert bench.speed_steps("demo-1/32-sign@1e-3", "100mbit", args) == 8
    assert bench.speed_steps("demo-1/32-sign", "20mbit", args) == 5
    assert bench.speed_steps("diloco-h16-olr0.7", "100mbit", args) == 18
    assert bench.speed_steps("diloco", "20mbit", args) == 34


def test_without_a_throttled_link_for_every_variant_the_best_is_picked_unthrottled():
    quality = {"ddp": _run([(10, 6.0)], 1.0, 1000), "demo-1/32-sign": _run([(10, 6.1)], 0.5, 10)}
    speed = {
        "ddp": {"unthrottled": _run([], 1.0, 1000), "20mbit": _run([], 8.0, 1000)},
        "demo-1/32-sign": {"unthrottled": _run([], 0.5, 10)},
    }
    analysis = bench.analyse(quality, speed, margin=0.02)
    assert analysis["best"] == "demo-1/32-sign" and analysis["best_at"] == "unthrottled"
    assert analysis["variants"]["demo-1/32-sign"]["unthrottled"]["speedup_to_target"] == 2.0
    assert "20mbit" not in analysis["variants"]["demo-1/32-sign"]  # not measured there


def test_headline_reports_the_default_and_the_best_within_the_loss_budget(monkeypatch):
    quality = {
        "ddp@3e-3": _run([(10, 7.0), (20, 6.0)], 1.0, 1000),
        "demo-1/32-sign@1e-3": _run([(10, 7.5), (20, 6.1)], 1.0, 1000),
        "demo-1/16-sign@1e-3": _run([(10, 6.0), (20, 6.05)], 1.0, 1000),
        "demo-1/64-sign@1e-3": _run([(10, 6.1), (20, 6.3)], 1.0, 1000),  # fastest to target, but +5% at the end
    }
    speed = {
        "ddp": {"100mbit": _run([], 10.0, 100_000)},
        "demo-1/32-sign": {"100mbit": _run([], 2.0, 1_000)},
        "demo-1/16-sign": {"100mbit": _run([], 2.5, 2_000)},
        "demo-1/64-sign": {"100mbit": _run([], 1.0, 500)},
    }
    analysis = bench.analyse(quality, speed, margin=0.02, compute_s=0.5)
    written = {}
    headline = importlib.import_module("headline")
    monkeypatch.setattr(headline, "update_headline", lambda section, values: written.update({section: values}))
    bench.write_headline(analysis, bench.REPO / "docs/results/x/results.json")
    section = written["flexdemo"]
    assert section["variant"] == "demo-1/32-sign@1e-3" and section["speedup_time_to_target_100mbit"] == 5.0
    assert section["best"]["variant"] == "demo-1/16-sign@1e-3"  # demo-1/64 is faster but outside 2%
    assert section["results"] == "docs/results/x/results.json" and section["bytes_ratio"] == 100.0


class _FakeWorker:
    """Stands in for a compute-only worker: writes the summary a real one would, with a step time per process."""

    launched: list[list[str]] = []

    def __init__(self, command: list[str], **_: object) -> None:
        self.launched.append(command)
        out = Path(command[command.index("--out") + 1])
        index = int(out.stem.rsplit("-", 1)[1])
        out.write_text(f'{{"strategy": "single", "median_step_s": {0.5 + index}, "step_seconds": [1.0]}}')
        self.exit_code = 0 if "broken" not in command else 3

    def wait(self) -> int:
        return self.exit_code


def _compute_only_args(tmp_path: Path, ranks_per_node: int, preset: str = "llama-tiny") -> argparse.Namespace:
    return argparse.Namespace(
        out_dir=tmp_path, ranks_per_node=ranks_per_node, reuse=False, preset=preset, batch_size=1, seq_len=128
    )


def test_compute_only_runs_one_process_per_testbed_rank_at_once(tmp_path, monkeypatch):
    _FakeWorker.launched = []
    monkeypatch.setattr(bench.subprocess, "Popen", _FakeWorker)
    summary = bench.run_compute_only(_compute_only_args(tmp_path, ranks_per_node=2))
    assert len(_FakeWorker.launched) == 4  # 2 nodes x 2 ranks share the cores, so all four run together
    assert summary["processes"] == 4 and summary["per_process_s"] == [0.5, 1.5, 2.5, 3.5]
    assert summary["median_step_s"] == 2.0 and "step_seconds" not in summary
    assert sorted(path.name for path in tmp_path.iterdir()) == ["compute-only.json"]  # the parts are cleaned up
    _FakeWorker.launched = []
    args = _compute_only_args(tmp_path, ranks_per_node=2)
    args.reuse = True
    assert bench.run_compute_only(args)["median_step_s"] == 2.0 and not _FakeWorker.launched  # reused
    args.ranks_per_node = 1
    assert bench.run_compute_only(args)["processes"] == 2 and len(_FakeWorker.launched) == 2  # other count: rerun


def test_compute_only_failure_names_the_exit_code_and_keeps_the_log(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.subprocess, "Popen", _FakeWorker)
    with pytest.raises(RuntimeError, match="exit 3"):
        bench.run_compute_only(_compute_only_args(tmp_path, ranks_per_node=1, preset="broken"))
    assert (tmp_path / "compute-only-0.log").exists()
