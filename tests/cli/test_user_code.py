"""The CLI takes a user's module as a stock ``LightningCLI`` script would: no DataModule, a module file in the cwd.

A plain Lightning module defines its own dataloaders, so ``data`` is optional (our DataModules stay selectable by
name), and ``lightning-hetero`` imports ``class_path: mynets.UserCNN`` from the current directory without
``PYTHONPATH=.``, as ``python script.py`` and ``python -m lightning_hetero`` do.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from lightning_hetero.cli import build_cli

REPO = Path(__file__).resolve().parents[2]
USER_MODULE = "tests.usercode.usernets.UserCNN"

# What pip writes for ``[project.scripts] lightning-hetero = "lightning_hetero.cli:main"``: a script in another
# directory (bin/), so sys.path[0] is that directory, not the user's working directory.
CONSOLE_SCRIPT = """\
import re
import sys
from lightning_hetero.cli import main
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
"""

MYNETS = '''\
"""A user's module file, next to the YAML: nothing of lightning_hetero in it."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyRegressor(L.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
'''

YAML = """\
model:
  class_path: mynets.TinyRegressor
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 3
  log_every_n_steps: 1
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: CSVLogger
    init_args:
      save_dir: logs
"""


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])  # not pytest's arguments


def test_data_is_optional_for_a_module_with_its_own_dataloaders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli([f"--model={USER_MODULE}", "--trainer.logger=false"], run=False)
    assert isinstance(cli.trainer, Trainer)
    assert type(cli.model).__name__ == "UserCNN"
    assert cli.datamodule is None


def test_fit_runs_a_module_with_its_own_dataloaders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(
        [
            "fit",
            f"--model={USER_MODULE}",
            "--model.train_items=32",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
        ]
    )
    assert cli.trainer.global_step == 2


def _user_directory(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "mynets.py").write_text(MYNETS)
    (work / "x.yaml").write_text(YAML)
    return work


def _fit(work: Path, *launcher: str) -> subprocess.CompletedProcess[str]:
    """``python <launcher> fit --config x.yaml`` in ``work``."""
    # The package is importable (as after `pip install -e .`), the user's directory is not on PYTHONPATH.
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, *launcher, "fit", "--config", "x.yaml"]
    return subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)


def _train_losses(work: Path) -> list[float]:
    (metrics,) = (work / "logs").rglob("metrics.csv")
    return [float(row["train_loss"]) for row in csv.DictReader(metrics.open()) if row.get("train_loss")]


@pytest.mark.timeout(300)
def test_console_script_imports_the_users_module_from_the_working_directory(tmp_path):
    work = _user_directory(tmp_path)
    script = tmp_path / "bin" / "lightning-hetero"
    script.parent.mkdir()
    script.write_text(CONSOLE_SCRIPT)
    result = _fit(work, str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(_train_losses(work)) == 3


@pytest.mark.timeout(300)
def test_python_dash_m_runs_the_users_module(tmp_path):
    work = _user_directory(tmp_path)
    result = _fit(work, "-m", "lightning_hetero")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _train_losses(work)
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_module_file_in_working_directory_is_importable_only_once_on_sys_path(tmp_path, monkeypatch):
    """main() puts the working directory first on sys.path, once, as ``python script.py`` puts the script's."""
    from lightning_hetero import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cli.put_working_directory_on_path()
    cli.put_working_directory_on_path()
    assert sys.path[0] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1


@pytest.mark.parametrize(
    "name",
    ["FlexDeMoStrategy", "MatFormerStrategy", "SubspacePipelineStrategy", "SparseFlipStrategy", "LayerwiseStrategy"],
)
def test_our_strategies_resolve_by_short_class_name(name, tmp_path, monkeypatch):
    """``class_path: MatFormerStrategy`` (with init_args) works like ``class_path: CSVLogger`` does for Lightning's."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "strategy.yaml"
    config.write_text(
        f"model: {USER_MODULE}\n"
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n"  # nothing is launched before fit
        f"  strategy:\n    class_path: {name}\n    init_args:\n      settings:\n        on_bad_payload: raise\n"
    )
    cli = build_cli(["--config", str(config)], run=False)
    assert type(cli.trainer.strategy).__name__ == name
    assert cli.trainer.strategy.settings.on_bad_payload == "raise"  # each strategy's typed settings
