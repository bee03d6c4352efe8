"""ValidationReport evaluates the same batches before and after fit and reports exp(mean loss)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_hetero.callbacks.eval_report import ValidationReport


class _Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return SimpleNamespace(loss=torch.nn.functional.mse_loss(self.linear(x), y))

    def training_step(self, batch, batch_idx):
        return self(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Data(LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator)
        self.rows = [{"x": x[i], "y": x[i, :1] * 2.0} for i in range(64)]

    def train_dataloader(self):
        return DataLoader(self.rows, batch_size=8)

    def val_dataloader(self):
        return DataLoader(self.rows[:24], batch_size=8)


def _fit(report: ValidationReport, **trainer_kwargs) -> _Regression:
    torch.manual_seed(0)
    module = _Regression()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=20,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[report],
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=_Data())
    return module


def test_before_and_after_are_exact_means_and_training_helps(capsys):
    torch.manual_seed(0)
    initial = _Regression()
    batches = list(_Data().val_dataloader())[:2]
    expected_before = sum(float(initial(**b).loss) * 8 for b in batches) / 16

    report = ValidationReport(limit_batches=2)
    trained = _fit(report)
    assert report.before == pytest.approx(expected_before, rel=1e-6)
    expected_after = sum(float(trained(**b).loss) * 8 for b in batches) / 16
    assert report.after == pytest.approx(expected_after, rel=1e-6)
    assert report.after < report.before
    assert trained.training, "the module is put back in train mode"


def test_prints_perplexity(caplog):
    report = ValidationReport(limit_batches=1)
    with caplog.at_level("INFO"):
        _fit(report)
    text = caplog.text
    assert f"perplexity {math.exp(report.before):.2f}" in text
    assert "after training" in text


def test_restored_before_value_is_kept():
    report = ValidationReport()
    report.load_state_dict({"before": 3.5})
    _fit(report)
    assert report.before == 3.5


def test_rejects_bad_limit():
    with pytest.raises(ValueError, match="limit_batches"):
        ValidationReport(limit_batches=0)
