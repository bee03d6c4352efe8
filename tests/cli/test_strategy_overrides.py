"""docs/flexdemo.md's ``--trainer.strategy.init_args.settings.<key>=<v>`` works whichever way the YAML names the
strategy: by class (``class_path: FlexDeMoStrategy``) or by its registered name (``strategy: flexdemo``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero.cli import build_cli
from lightning_hetero.cli.strategy_flags import class_form, first_strategy_override, without_strategy_overrides
from lightning_hetero.flexdemo.settings import FlexDeMoSettings

YAML = """\
trainer:
  logger: false
  accelerator: cpu
  devices: 1
  strategy: {strategy}
model:
  class_path: CausalLMModule
  init_args: {{preset: llama-tiny}}
"""
BY_NAME = "flexdemo"
BY_CLASS = "{class_path: FlexDeMoStrategy}"
OVERRIDES = [
    "--trainer.strategy.init_args.settings.shard_size=1",
    "--trainer.strategy.init_args.settings.replication.kind",  # value as the next argument
    "topk",
    "--trainer.strategy.settings.drift_check_every=5",  # jsonargparse's form without init_args
]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])


def _config(tmp_path: Path, strategy: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(YAML.format(strategy=strategy))
    return str(path)


@pytest.mark.parametrize("strategy", [BY_NAME, BY_CLASS], ids=["by_name", "by_class"])
def test_settings_override_reaches_the_strategy(tmp_path, strategy):
    cli = build_cli(["--config", _config(tmp_path, strategy), *OVERRIDES], run=False)
    settings = cli.trainer.strategy.settings
    assert type(cli.trainer.strategy).__name__ == "FlexDeMoStrategy"
    assert isinstance(settings, FlexDeMoSettings)
    assert (settings.shard_size, settings.replication.kind, settings.drift_check_every) == (1, "topk", 5)


@pytest.mark.parametrize("strategy", [BY_NAME, BY_CLASS], ids=["by_name", "by_class"])
def test_fit_print_config_shows_the_override(tmp_path, capsys, strategy):
    """With the ``fit`` subcommand (and ``--print_config`` before the overrides, which print and exit)."""
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", _config(tmp_path, strategy), "--print_config", *OVERRIDES])
    assert exit_info.value.code == 0
    strategy_config = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy_config["class_path"].endswith(".FlexDeMoStrategy")
    settings = strategy_config["init_args"]["settings"]
    assert (settings["shard_size"], settings["replication"]["kind"], settings["drift_check_every"]) == (1, "topk", 5)


def test_spawn_alias_keeps_its_bound_arguments(tmp_path):
    cli = build_cli(["--config", _config(tmp_path, "flexdemo_spawn"), OVERRIDES[0]], run=False)
    assert cli.trainer.strategy._start_method == "spawn"
    assert cli.trainer.strategy.settings.shard_size == 1


def test_without_overrides_a_name_stays_a_name(tmp_path):
    """No behaviour change for a config without overrides: the name goes to the Trainer's registry as before."""
    cli = build_cli(["--config", _config(tmp_path, BY_NAME)], run=False)
    assert cli.config.trainer.strategy == "flexdemo"
    assert type(cli.trainer.strategy).__name__ == "FlexDeMoStrategy"


def test_helpers():
    args = ["fit", "--config", "x.yaml", "--print_config", *OVERRIDES, "--trainer.strategy.help", "FlexDeMoStrategy"]
    assert first_strategy_override(args) == 4
    assert without_strategy_overrides(args) == [
        "fit",
        "--config",
        "x.yaml",
        "--trainer.strategy.help",
        "FlexDeMoStrategy",
    ]
    assert first_strategy_override(["--trainer.strategy=flexdemo", "--trainer.strategy.class_path=X"]) is None
    assert class_form("FlexDeMo", StrategyRegistry) == {
        "class_path": "lightning_hetero.strategies.flexdemo.trainer.FlexDeMoStrategy"
    }
    assert class_form("matformer_spawn", StrategyRegistry)["init_args"] == {"start_method": "spawn"}
    assert class_form("nonesuch", StrategyRegistry) is None
