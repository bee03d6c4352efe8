"""A new user's mistakes end in one screen that names the fix, exit code 2, before any worker starts.

Each case runs once as the user would (``python -m lightning_hetero fit --config x.yaml`` from the YAML's folder, a
subprocess) and otherwise in-process through :func:`build_cli`: a strategy-name typo, a 0.1 YAML with several renamed
keys, a ``class_path`` whose module is not on the import path, GPT-2 under ``subspace_pipeline`` and a MatFormer tier
list that fits neither the ranks nor the nodes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero.cli import build_cli
from lightning_hetero.cli.errors import renamed_keys, unimportable_class_message
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.strategies.registry import unknown_strategy_message

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 12
"""One screen: the message, its fix and the help tip (the usage dump alone was 50 lines)."""

MYNETS = """\
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyRegressor(L.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
"""

USER_YAML = """\
model:
  class_path: {model}
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 1
  logger: false
  enable_checkpointing: false
  strategy: {strategy}
"""

OLD_FLEXDEMO = """\
  strategy:
    class_path: FlexDeMoStrategy
    init_args:
      compression: 0.03
      shard_size: 2
      replicator: demo
      overlap: false
      drift_check_every: 3"""

HF_YAML = """\
model:
  class_path: CausalLMModule
  init_args: {{preset: {preset}}}
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 1
  logger: false
  strategy: {strategy}
"""

EXPECTED = {
    "typo": ["Did you mean 'flexdemo'?", "matformer, flexdemo, subspace_pipeline, sparseflip, layerwise"],
    "renamed": [
        "FlexDeMoStrategy: 5 key(s) renamed in 0.2",
        "'compression' -> 'settings.replication.kept_fraction'",
        "'shard_size' -> 'settings.shard_size'",
        "'replicator' -> 'settings.replication.kind'",
        "'overlap' -> 'settings.overlap'",
        "'drift_check_every' -> 'settings.drift_check_every'",
    ],
    "module": ["cannot import class_path 'mynets.TinyRegressor'", "working directory", "PYTHONPATH", "mynets.py"],
}


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])  # in-process runs: only the args given to build_cli
    monkeypatch.delitem(sys.modules, "mynets", raising=False)  # each test's own mynets.py (or none)


def _user_files(work: Path, case: str) -> Path:
    """The user's folder for ``case``: ``x.yaml`` (and ``mynets.py`` next to it unless the module is missing)."""
    work.mkdir(parents=True, exist_ok=True)
    if case != "module":
        (work / "mynets.py").write_text(MYNETS)
    strategy = {"typo": "flexdemmo", "renamed": "\n" + OLD_FLEXDEMO.removeprefix("  strategy:\n")}.get(case, "auto")
    text = USER_YAML.format(model="mynets.TinyRegressor", strategy=strategy)
    (work / "x.yaml").write_text(text.replace("  strategy: \n", "  strategy:\n"))
    return work / "x.yaml"


@pytest.mark.parametrize("case", ["typo", "renamed", "module"])
def test_console_error_is_one_screen_naming_the_fix(tmp_path, case):
    """``python -m lightning_hetero fit --config x.yaml`` from the user's folder, as after ``pip install``."""
    config = _user_files(tmp_path, case)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "lightning_hetero", "fit", "--config", config.name]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) <= MAX_LINES, result.stderr
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr
    for expected in EXPECTED[case]:
        assert expected in result.stderr, (expected, result.stderr)
    if case == "module":
        assert str(tmp_path) in result.stderr  # names the working directory it imported from


def _cli_error(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_cli(args, run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if line.strip()]) <= MAX_LINES, err
    assert "usage:" not in err
    return err


# ---------------------------------------------------------------------------------------------- strategy names
@pytest.mark.parametrize(
    ("given", "suggested"),
    [
        ("flexdemmo", "flexdemo"),
        ("FlexDemo2", "flexdemo"),
        ("matformr", "matformer"),
        ("subspace", "subspace_pipeline"),
        ("FlexDeMoStrategy", "flexdemo"),  # a class name where a registered name goes
    ],
)
def test_unknown_strategy_name_suggests_the_closest(given, suggested):
    message = unknown_strategy_message(given, StrategyRegistry.available_strategies())
    assert f"Did you mean {suggested!r}?" in message
    assert "matformer, flexdemo, subspace_pipeline, sparseflip, layerwise" in message


def test_registered_names_and_auto_are_not_refused():
    names = StrategyRegistry.available_strategies()
    for name in ("auto", "flexdemo", "FLEXDEMO", "ddp", "layerwise_spawn"):
        assert unknown_strategy_message(name, names) is None
    assert "Did you mean" not in unknown_strategy_message("qqqqqq", names)  # nothing close: no guess


@pytest.mark.parametrize("how", ["yaml", "flag", "flag_with_override"])
def test_strategy_typo_in_yaml_or_flag(tmp_path, monkeypatch, capsys, how):
    monkeypatch.chdir(tmp_path)
    config = _user_files(tmp_path, "typo" if how == "yaml" else "ok")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["--config", str(config)]
    if how != "yaml":
        args.append("--trainer.strategy=flexdemmo")
    if how == "flag_with_override":
        args.append("--trainer.strategy.init_args.settings.shard_size=1")
    err = _cli_error(capsys, args)
    assert "strategy='flexdemmo' is not a registered strategy name. Did you mean 'flexdemo'?" in err


def test_trainer_typo_is_lightnings_error():
    """``Trainer(strategy="flexdemmo")`` raises in Lightning's own check, before any hook of ours runs (see
    docs/quickstart.md): this pins its wording, so that a Lightning upgrade that changes it is noticed."""
    with pytest.raises(ValueError, match="You selected an invalid strategy name: `strategy='flexdemmo'`"):
        Trainer(strategy="flexdemmo", accelerator="cpu", devices=1, logger=False)


# ---------------------------------------------------------------------------------------------- renamed keys
def test_every_renamed_yaml_key_in_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _cli_error(capsys, ["--config", str(_user_files(tmp_path, "renamed"))])
    for expected in EXPECTED["renamed"]:
        assert expected in err


def test_every_renamed_flag_in_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = ["--trainer.strategy.init_args.compression=0.1", "--trainer.strategy.init_args.overlap", "false"]
    for strategy in ("--trainer.strategy=FlexDeMoStrategy", "--trainer.strategy=flexdemo"):
        err = _cli_error(capsys, ["--config", str(_user_files(tmp_path, "ok")), strategy, *flags])
        assert "FlexDeMoStrategy: 2 key(s) renamed in 0.2" in err
        assert (
            "'compression' -> 'settings.replication.kept_fraction'" in err and "'overlap' -> 'settings.overlap'" in err
        )


def test_renamed_keys_skips_keys_already_in_their_new_place():
    paths = [["settings", "shard_size"], ["settings", "compression"], ["replicator_options", "values"], ["bogus"]]
    assert renamed_keys(paths, FlexDeMoSettings.RENAMED) == ["compression", "replicator_options"]


# ---------------------------------------------------------------------------------------------- missing modules
def test_missing_module_names_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = _cli_error(capsys, ["--config", str(_user_files(tmp_path, "module"))])
    for expected in EXPECTED["module"]:
        assert expected in err
    assert str(tmp_path) in err


def test_missing_dependency_of_the_module_says_install_it():
    message = (
        "Parser key \"model\":\n  Errors:\n    - Problem with given class_path 'badnets.Net':\n"
        "        No module named 'notinstalled'\n"
    )
    text = unimportable_class_message(message, cwd="/somewhere")
    assert text.startswith("model: importing class_path 'badnets.Net' failed: 'badnets' imports 'notinstalled'")
    assert "working directory" not in text
    assert unimportable_class_message("Option 'x' is not accepted") is None


# ---------------------------------------------------------------------------------------------- launch checks
def _hf_config(tmp_path: Path, preset: str, strategy: str) -> str:
    path = tmp_path / "hf.yaml"
    path.write_text(HF_YAML.format(preset=preset, strategy=strategy))
    return str(path)


def test_gpt2_under_subspace_pipeline_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = _cli_error(capsys, ["--config", _hf_config(tmp_path, "gpt2-tiny", "subspace_pipeline")])
    assert "subspace_pipeline cannot split a 'gpt2' model" in err and "llama-tiny" in err


def test_llama_under_subspace_pipeline_passes_the_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", _hf_config(tmp_path, "llama-tiny", "subspace_pipeline")], run=False)
    assert type(cli.trainer.strategy).__name__ == "SubspacePipelineStrategy"
    assert cli.model.model is None  # checked from the config, nothing built


def test_tier_list_that_fits_no_launch_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    strategy = "{class_path: MatFormerStrategy, init_args: {settings: {tiers: [0, 1, 2]}}}"
    err = _cli_error(capsys, ["--config", _hf_config(tmp_path, "llama-tiny", strategy)])
    assert "settings.tiers=[0, 1, 2] has 3 entries, but the run has 2 ranks" in err
    assert "Give one entry per global rank (2) or one per node (1)" in err


def test_model_types_from_built_models_and_from_configs():
    from lightning.pytorch import LightningModule
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_hetero.cli import model_types
    from lightning_hetero.models import CausalLMModule

    class Holder(LightningModule):  # a user's module that builds its HF model in __init__
        def __init__(self) -> None:
            super().__init__()
            self.net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))

    assert model_types(Holder()) == {"gpt2"}
    assert model_types(CausalLMModule(preset="llama-tiny")) == {"llama"}  # from the config, nothing built
    assert model_types(LightningModule()) == set()  # nothing known yet: the workers check


def test_subspace_check_model_types():
    from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings

    settings = SubspacePipelineSettings()
    for ok in (set(), {"llama"}, {"qwen3"}, {"llama", "clip"}):
        settings.check_model_types(ok)
    with pytest.raises(ValueError, match="subspace_pipeline cannot split a 'gpt2' model"):
        settings.check_model_types({"gpt2"})
