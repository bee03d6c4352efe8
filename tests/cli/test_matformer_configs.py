"""The MatFormer YAMLs write their tier list once: the tier callbacks read it from the strategy (or the sampler)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_hetero import MatFormerStrategy
from lightning_hetero.cli import build_cli
from lightning_hetero.matformer.settings import MatFormerSettings
from lightning_hetero.strategies.matformer.callbacks import MatFormerSampler, TierEvaluation, TierExport

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("matformer_*.yaml"))


def test_there_are_matformer_configs():
    assert {path.name for path in CONFIGS} >= {"matformer_llama_shakespeare.yaml", "matformer_sampler_llama.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_tiers_are_written_once_and_every_tier_callback_uses_them(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    written = [line for line in config.read_text().splitlines() if line.strip().startswith("tiers:")]
    assert len(written) == 1, written
    cli = build_cli(["--config", str(config)], run=False)
    trainer = cli.trainer
    if isinstance(trainer.strategy, MatFormerStrategy) and trainer.strategy.settings.auto:
        expected = trainer.strategy.settings.auto_settings.candidates  # before setup chose: every candidate
    elif isinstance(trainer.strategy, MatFormerStrategy):
        expected = sorted(set(trainer.strategy.settings.tiers))
    else:
        (sampler,) = [callback for callback in trainer.callbacks if isinstance(callback, MatFormerSampler)]
        expected = sampler.tiers
    tier_callbacks = [callback for callback in trainer.callbacks if isinstance(callback, (TierEvaluation, TierExport))]
    assert len(tier_callbacks) == 2
    for callback in tier_callbacks:
        callback.setup(trainer, cli.model, "fit")
        assert callback.resolved_tiers == expected, type(callback).__name__


def test_the_documented_command_line_override_reaches_the_settings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    config = REPO / "configs" / "matformer_llama_shakespeare.yaml"
    cli = build_cli(
        [
            "--config",
            str(config),
            "--trainer.devices",
            "4",
            "--trainer.strategy.init_args.settings.tiers",
            "[0, 0, 1, 1]",
        ],
        run=False,
    )
    settings = cli.trainer.strategy.settings
    assert isinstance(settings, MatFormerSettings)
    assert settings.tiers == [0, 0, 1, 1] and settings.log_tier_losses is True  # the rest of the YAML's settings
    assert cli.trainer.strategy.tiers == [0, 0, 1, 1]
