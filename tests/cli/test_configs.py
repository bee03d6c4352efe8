"""Every YAML in configs/ parses and instantiates; the real console script trains the quickstart for a few steps."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import LightningDataModule, LightningModule, Trainer

from lightning_hetero.cli import build_cli

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {path.name for path in CONFIGS}
    assert {"quickstart.yaml", "finetune_smollm2.yaml"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_every_config_parses_and_instantiates(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs/ of the instantiated loggers land here
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    cli = build_cli(["--config", str(config)], run=False)
    assert isinstance(cli.trainer, Trainer)
    assert isinstance(cli.model, LightningModule)
    assert isinstance(cli.datamodule, LightningDataModule)
    assert cli.model.model is None, "HF models are built in configure_model, not at parse time"


def test_short_class_names_resolve(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(
        [
            "--model=CausalLMModule",
            "--model.preset=gpt2-tiny",
            "--data=ShakespeareDataModule",
            "--trainer.logger=false",
            "--trainer.callbacks+=CommunicationMonitor",
        ],
        run=False,
    )
    assert type(cli.model).__name__ == "CausalLMModule"
    assert type(cli.datamodule).__name__ == "ShakespeareDataModule"


def test_bad_argument_fails_at_parse_time(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        build_cli(["--config", str(REPO / "configs/quickstart.yaml"), "--model.init_args.learning_rat=1"], run=False)
    assert "learning_rat" in capsys.readouterr().err


@pytest.mark.assets
@pytest.mark.timeout(600)
def test_quickstart_console_script_runs_five_steps(tmp_path):
    """The README's main command, shortened: the installed `lightning-hetero` script, a real fit, metrics on disk."""
    executable = shutil.which("lightning-hetero")
    command = [executable] if executable else [sys.executable, "-m", "lightning_hetero"]
    out = tmp_path / "run"
    args = [
        "fit",
        "--config",
        str(REPO / "configs/quickstart.yaml"),
        "--trainer.max_steps",
        "5",
        "--trainer.val_check_interval",
        "5",
        "--trainer.limit_val_batches",
        "2",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.default_root_dir",
        str(out),
        "--trainer.logger.init_args.save_dir",
        str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "[ValidationReport] before training" in log and "[ValidationReport] after training" in log
    (metrics_file,) = out.rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    train_losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    perplexities = [float(row["val/perplexity"]) for row in rows if row.get("val/perplexity")]
    assert len(train_losses) == 5
    assert perplexities and all(1.0 < value < 1e5 for value in perplexities)
    assert list(out.rglob("*.ckpt")), "the quickstart checkpoints under default_root_dir"


@pytest.mark.assets
@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_evaluation_subcommands_run(subcommand, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    monkeypatch.setenv("LIGHTNING_HETERO_CACHE", str(tmp_path / "cache"))
    limit = {"validate": "limit_val_batches", "test": "limit_test_batches", "predict": "limit_predict_batches"}
    build_cli(
        [
            subcommand,
            "--config",
            str(REPO / "configs/quickstart.yaml"),
            "--data.init_args.max_chars=300000",
            "--data.init_args.vocab_size=512",
            f"--trainer.{limit[subcommand]}=2",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
        ]
    )
    if subcommand != "predict":
        assert f"{'val' if subcommand == 'validate' else 'test'}/perplexity" in capsys.readouterr().out
