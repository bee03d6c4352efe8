"""ValidationReport evaluates the same batches before and after fit, through the module's own validation_step."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
import torchmetrics
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_hetero.callbacks.eval_report import ValidationReport
from lightning_hetero.data.base import fair_prefix


class _Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return SimpleNamespace(loss=torch.nn.functional.mse_loss(self.linear(x), y))

    def training_step(self, batch, batch_idx):
        return self(**batch).loss

    def validation_step(self, batch, batch_idx):
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


def _trainer(report: ValidationReport, **trainer_kwargs) -> Trainer:
    settings = dict(
        accelerator="cpu",
        max_steps=20,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[report],
    )
    settings.update(trainer_kwargs)
    return Trainer(**settings)


def _fit(report: ValidationReport, **trainer_kwargs) -> _Regression:
    torch.manual_seed(0)
    module = _Regression()
    _trainer(report, **trainer_kwargs).fit(module, datamodule=_Data())
    return module


def _fixed_order_mean(module: _Regression, limit: int) -> float:
    """The mean loss over the ``limit`` batches ValidationReport reads: the loader's seeded fixed permutation."""
    loader = fair_prefix(_Data().val_dataloader(), limit)
    batches = list(itertools.islice(loader, limit))
    with torch.no_grad():
        return sum(float(module(**b).loss) * len(b["y"]) for b in batches) / sum(len(b["y"]) for b in batches)


def test_before_and_after_are_exact_means_and_training_helps():
    torch.manual_seed(0)
    initial = _Regression()
    expected_before = _fixed_order_mean(initial, 2)

    report = ValidationReport(limit_batches=2)
    trained = _fit(report)
    assert report.before == pytest.approx(expected_before, rel=1e-6)
    assert report.after == pytest.approx(_fixed_order_mean(trained, 2), rel=1e-6)
    assert report.after < report.before
    assert trained.training, "the module is put back in train mode"


class _LogsValLoss(_Regression):
    """A user's module that logs Lightning's ``val_loss`` (epoch mean, weighted by the inferred batch size)."""

    def validation_step(self, batch, batch_idx):
        loss = self(**batch).loss
        self.log("val_loss", loss)
        return loss


def test_same_batches_same_moment_equal_lightnings_val_loss():
    # docs/metrics.md: on one process, over the same batches of the same model at the same moment (the last
    # validation runs at the last step), ValidationReport's "after" is Lightning's val_loss; they differ only by
    # batches, ranks, width or moment.
    torch.manual_seed(0)
    module = _LogsValLoss()
    report = ValidationReport(limit_batches=None)
    trainer = _trainer(report, max_steps=16, check_val_every_n_epoch=1)  # 8 batches per epoch: validation at 8, 16
    trainer.fit(module, datamodule=_Data())
    assert report.after == pytest.approx(float(trainer.callback_metrics["val_loss"]), rel=1e-6)


def test_all_batches_without_a_limit_are_the_plain_mean():
    torch.manual_seed(0)
    initial = _Regression()
    with torch.no_grad():
        expected = sum(float(initial(**b).loss) * 8 for b in _Data().val_dataloader()) / 24
    report = ValidationReport(limit_batches=None)
    _fit(report, max_steps=1)
    assert report.before == pytest.approx(expected, rel=1e-6)


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


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"limit_batches": 0}, "limit_batches"),
        ({"metric": ""}, "metric"),
        ({"metric": 3}, "metric"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ValidationReport(**kwargs)


# ------------------------------------------------------------------------------------ modules written by users
class _UserStyle(LightningModule):
    """Loss computed in the steps from ``self.net``; no ``forward(**batch)``; the data is ``(x, y)`` tuples."""

    def __init__(self, validation: str = "return") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 3)
        self.validation = validation
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
        self.steps_seen = 0

    def training_step(self, batch, batch_idx):
        self.steps_seen += 1
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.accuracy(logits, y)
        self.log("val_acc", self.accuracy, sync_dist=True)
        if self.validation == "return":
            return loss
        self.log("val_loss", loss, sync_dist=True)
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def _rows(self, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(count, 4, generator=generator)
        y = x[:, :3].argmax(-1)
        return [(x[i], y[i]) for i in range(count)]

    def train_dataloader(self):
        return DataLoader(self._rows(32, 0), batch_size=8)

    def val_dataloader(self):
        return DataLoader(self._rows(20, 1), batch_size=8)  # 8 + 8 + 4: weights matter


def _user_mean(module: _UserStyle, what: str = "loss") -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in module.val_dataloader():
            logits = module.net(x)
            value = (
                torch.nn.functional.cross_entropy(logits, y)
                if what == "loss"
                else (logits.argmax(-1) == y).float().mean()
            )
            total += float(value) * len(y)
            count += len(y)
    return total / count


@pytest.mark.parametrize("validation", ["return", "log"])
def test_user_module_with_its_own_loaders_and_no_forward(validation):
    module = _UserStyle(validation)
    expected_before = _user_mean(module)
    report = ValidationReport(limit_batches=None, perplexity=False)
    trainer = _trainer(report, max_steps=4, limit_val_batches=0)
    trainer.fit(module)
    assert report.before == pytest.approx(expected_before, rel=1e-6)
    assert report.after == pytest.approx(_user_mean(module), rel=1e-6)
    # Our evaluation logged nothing through Lightning and left the module's metric state alone.
    assert "val_loss" not in trainer.callback_metrics and "val_acc" not in trainer.callback_metrics
    assert int(module.accuracy._update_count) == 0


def test_metric_name_picks_a_logged_value():
    module = _UserStyle("log")
    expected = _user_mean(module, "accuracy")
    report = ValidationReport(limit_batches=None, perplexity=False, metric="val_acc")
    _trainer(report, max_steps=1, limit_val_batches=0).fit(module)
    assert report.before == pytest.approx(expected, rel=1e-6)


def test_unknown_metric_name_fails_before_training_and_lists_what_was_logged():
    module = _UserStyle("log")
    report = ValidationReport(metric="val/accuracy")
    with pytest.raises(RuntimeError, match=r"metric='val/accuracy'.*'val_acc', 'val_loss'"):
        _trainer(report, max_steps=1, limit_val_batches=0).fit(module)
    assert module.steps_seen == 0


def test_validation_metric_state_is_untouched_during_a_validation_epoch():
    """Lightning's own val_acc after fit covers only the validation loop's batches, not ours."""
    module = _UserStyle("log")
    report = ValidationReport(limit_batches=None, perplexity=False)
    trainer = _trainer(report, max_steps=2, limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0)
    trainer.fit(module)
    x, y = next(iter(module.val_dataloader()))
    with torch.no_grad():
        expected = float((module.net(x).argmax(-1) == y).float().mean())
    assert float(trainer.callback_metrics["val_acc"]) == pytest.approx(expected)


class _NoValidation(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.steps_seen = 0

    def training_step(self, batch, batch_idx):
        self.steps_seen += 1
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.randn(16, 4), batch_size=4)

    def val_dataloader(self):
        return DataLoader(torch.randn(16, 4), batch_size=4)


def test_a_module_without_validation_step_fails_before_training_with_what_to_add():
    module = _NoValidation()
    with pytest.raises(TypeError, match=r"ValidationReport.*_NoValidation.*validation_step.*validation_loss"):
        _trainer(ValidationReport(), max_steps=2).fit(module)
    assert module.steps_seen == 0


class _HookOnly(_NoValidation):
    def validation_loss(self, batch):
        return self.net(batch).pow(2).mean()


def test_the_validation_loss_hook_is_enough():
    module = _HookOnly()
    report = ValidationReport(limit_batches=None, perplexity=False)
    _trainer(report, max_steps=1).fit(module)
    assert report.before is not None and report.after is not None and report.before != report.after
