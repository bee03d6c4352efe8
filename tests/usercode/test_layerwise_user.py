"""Layerwise training and the sparseflip summary on modules written the way users write them (``usernets``).

- ``GreedyLayerwise`` added to a plain Trainer with Lightning's default DDP (``strategy="ddp"``, no
  ``find_unused_parameters``) on 2 spawned gloo ranks: every stage trains, the ranks stay identical (auxiliary heads
  included), and the export loads with ``from_pretrained``.
- ``LayerwiseStrategy`` (DGL, ``strategy: layerwise``) on a user module on 2 ranks with ``export_dir``: the export
  loads with ``from_pretrained`` and gives the logits of the trained stages; rank 0's progress bar shows the model's
  loss (the last stage's) as ``train/loss``, its own auxiliary loss only as ``train/stage0_loss``.
- both on a user CNN whose loaders yield ``(x, y)`` tuples (not HF dicts), 2 ranks each.
- ``SparseFlipStrategy`` on ``UserCNN`` (2 ranks): next to Lightning's model summary, whose "Total params" counts
  parameters only, rank 0 prints how many low-bit weights (int8 code buffers) the model has.

The Trainer runs inside :func:`~lightning_hetero.testing.run_distributed` workers: the process group exists already
(Lightning sees ``LOCAL_RANK`` and launches nothing), so ``strategy="ddp"`` never runs in the pytest process.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn
from torch.utils.data import DataLoader

from lightning_hetero.layerwise.settings import LayerwiseSettings
from lightning_hetero.sparseflip.layers import lowbit_layers
from lightning_hetero.strategies.layerwise.callbacks import GreedyLayerwise
from lightning_hetero.strategies.layerwise.trainer import LayerwiseStrategy
from lightning_hetero.strategies.sparseflip.trainer import SparseFlipStrategy
from lightning_hetero.testing import run_distributed
from tests.fixtures import Recorder
from tests.usercode.usernets import Progressions, UserCNN, UserLlama


class _Record(Callback):
    """What each step looked like: the stage, the logged loss, the progress-bar keys."""

    def __init__(self, greedy: GreedyLayerwise) -> None:
        self.greedy, self.steps = greedy, []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        stages = self.greedy.stages
        self.steps.append((stages.stage, float(outputs["loss"])))
        if stages.stage == 0:  # the auxiliary head as stage 0 leaves it (before anything could re-sync it)
            self.aux = {k: v.detach().clone() for k, v in stages.aux_heads.state_dict().items()}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.bar = dict(trainer.progress_bar_metrics)


class UserLlamaWithTemperature(UserLlama):
    """A user's module with a parameter outside the HF model (a learned loss temperature) that its own
    ``training_step`` uses: under GreedyLayerwise the stage losses never reach it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log_temperature = nn.Parameter(torch.zeros(()))

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss * self.log_temperature.exp()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def train_dataloader(self) -> DataLoader:
        # the same batch every epoch: a resumed run sees the batches of the uninterrupted one whatever epoch
        # Lightning counts a checkpoint taken at max_steps in
        return DataLoader(Progressions(self.hparams.train_items, seed=0), batch_size=self.hparams.batch_size)


def _greedy_fit(out: Path, max_steps: int, save: Path | None = None, ckpt_path: Path | None = None) -> dict[str, Any]:
    greedy = GreedyLayerwise(stage_steps=3, export_dir=str(out / "export"))
    record = _Record(greedy)
    module = UserLlamaWithTemperature(train_items=8, batch_size=4)  # one batch an epoch on each of 2 ranks
    torch.manual_seed(100 + torch.distributed.get_rank())  # the aux heads start different on every rank
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[greedy, record], limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)  # every rank calls it, rank 0 writes; at an epoch's end, so resume is exact
    return {
        "steps": record.steps,
        "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "aux": getattr(record, "aux", None),
        "aux_final": {k: v.detach().clone() for k, v in greedy.stages.aux_heads.state_dict().items()},
        "requires_grad": all(p.requires_grad for p in module.parameters()),
    }


def _greedy_ddp_worker(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    straight = _greedy_fit(out, 6)
    checkpoint = out / "step4.ckpt"
    _greedy_fit(out / "first", 4, save=checkpoint)
    resumed = _greedy_fit(out / "resumed", 6, ckpt_path=checkpoint)  # in the middle of stage 1
    return {"straight": straight, "resumed": resumed}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_greedy_layerwise_under_default_ddp_on_two_ranks(tmp_path: Path) -> None:
    results = [result["straight"] for result in run_distributed(_greedy_ddp_worker, 2, tmp_path, timeout=500)]
    for result in results:
        assert [stage for stage, _ in result["steps"]] == [0, 0, 0, 1, 1, 1]
        assert result["requires_grad"]  # the model is an ordinary model again after fit
    first, second = results
    for name, value in first["state"].items():  # DDP kept the model's replicas identical ...
        assert torch.equal(value, second["state"][name]), name
    for name, value in first["aux"].items():  # ... and the auxiliary heads, which are not part of the module
        assert torch.equal(value, second["aux"][name]), name
    # the exported model is the trained one
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    for name, value in exported.state_dict().items():
        assert torch.equal(value, first["state"][f"model.{name}"]), name
    batch = {"input_ids": Progressions(4, seed=5).ids}
    assert exported(**batch).logits.isfinite().all()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_greedy_layerwise_resumes_under_ddp_bit_for_bit(tmp_path: Path) -> None:
    for result in run_distributed(_greedy_ddp_worker, 2, tmp_path, timeout=500):
        straight, resumed = result["straight"], result["resumed"]
        assert resumed["steps"] == straight["steps"][4:]  # same stages, same losses
        for name, value in straight["state"].items():
            assert torch.equal(value, resumed["state"][name]), name
        for name, value in straight["aux_final"].items():
            assert torch.equal(value, resumed["aux_final"][name]), name


def _dgl_worker(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = UserLlama(train_items=32, batch_size=4)
    losses = Recorder(keep=())
    strategy = LayerwiseStrategy(settings=LayerwiseSettings(export_dir=str(out / "dgl")))  # 2 stages: the default
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy,
        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[losses],
    )  # fmt: skip
    trainer.fit(module)
    batch = {"input_ids": Progressions(4, seed=5).ids}
    logits = trainer.strategy.runtime.predict(batch)  # forward through the trained stages (collective)
    return {
        "logits": logits,
        "bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
        "losses": losses.losses,
        "model_loss": trainer.strategy.runtime.model_loss,
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dgl_layerwise_on_a_user_module_exports_the_trained_model(tmp_path: Path) -> None:
    results = run_distributed(_dgl_worker, 2, tmp_path, timeout=500)
    first, last = results
    # rank 0's progress bar: its own (auxiliary) loss under the stage's name, and the model's, the last stage's, as
    # train/loss (one meaning per name: docs/metrics.md)
    assert first["bar"]["train/stage0_loss"] == first["losses"][-1]
    assert first["bar"]["train/loss"] in last["losses"]  # the newest that had arrived (it may lag)
    assert first["bar"]["train/loss"] != first["losses"][-1]  # not stage 0's auxiliary loss
    assert first["model_loss"] == last["losses"][-1]  # all of them have arrived by the end of fit
    assert last["bar"]["train/loss"] == last["losses"][-1]
    assert first["logits"] is None and last["logits"] is not None
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "dgl").eval()
    with torch.no_grad():
        logits = exported(input_ids=Progressions(4, seed=5).ids).logits
    torch.testing.assert_close(logits, results[1]["logits"], rtol=1e-5, atol=1e-5)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _sparseflip_summary_worker(rank: int, world_size: int) -> dict[str, Any]:
    lines = _Lines()
    logging.getLogger("lightning.pytorch").addHandler(lines)  # rank_zero_info and the model summary log here
    module = UserCNN(train_items=64)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=SparseFlipStrategy(), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=True, limit_val_batches=0,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module)
    codes = sum(layer.codes.numel() for _, layer in lowbit_layers(module))
    return {"lines": lines.lines, "codes": codes, "summary_total": ModelSummary(module).total_parameters}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sparseflip_reports_the_low_bit_weights_next_to_the_model_summary() -> None:
    first, second = run_distributed(_sparseflip_summary_worker, 2, timeout=300)
    # the summary's "Total params" leaves out most of the model: the low-bit weights are int8 code buffers
    assert first["codes"] > 10 * first["summary_total"]
    expected = f"low-bit weights: {first['codes']:,} (ternary codes"
    report = [line for line in first["lines"] if expected in line]
    assert len(report) == 1, first["lines"]  # printed once (during setup, so before the summary's table)
    assert f"counts the {first['summary_total']:,} fp parameters" in report[0]
    assert not any("low-bit weights" in line for line in second["lines"])  # rank 0 only


class UserTwoConvCNN(UserCNN):
    """``UserCNN`` with two conv stages (so there are two blocks to train layerwise); ``(x, y)`` tuple batches."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(8 * 8 * 8, 4),
        )  # fmt: skip


def _tuple_batches_worker(rank: int, world_size: int) -> dict[str, Any]:
    common = dict(
        accelerator="cpu", devices=world_size, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
    )  # fmt: skip
    greedy = GreedyLayerwise(stage_steps=2)
    record = _Record(greedy)
    greedy_module = UserTwoConvCNN(train_items=64)
    trainer = L.Trainer(strategy="ddp", callbacks=[greedy, record], **common)
    trainer.fit(greedy_module)
    greedy_val = float(trainer.callback_metrics["val_loss"])
    dgl_module = UserTwoConvCNN(train_items=64)
    losses = Recorder(keep=())
    trainer = L.Trainer(strategy=LayerwiseStrategy(), callbacks=[losses], **common)
    trainer.fit(dgl_module)
    return {
        "greedy_steps": record.steps,
        "greedy_state": {k: v.detach().clone() for k, v in greedy_module.state_dict().items()},
        "greedy_val": greedy_val,
        "dgl_losses": losses.losses,
        "dgl_val": float(trainer.callback_metrics["val/loss"]),
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tuple_batches_train_layerwise_greedy_under_ddp_and_dgl() -> None:
    first, second = run_distributed(_tuple_batches_worker, 2, timeout=500)
    for result in (first, second):
        assert [stage for stage, _ in result["greedy_steps"]] == [0, 0, 1, 1]
        assert all(torch.isfinite(torch.tensor(loss)) for _, loss in result["greedy_steps"])
        assert len(result["dgl_losses"]) == 4 and torch.isfinite(torch.tensor(result["dgl_losses"])).all()
    for name, value in first["greedy_state"].items():
        assert torch.equal(value, second["greedy_state"][name]), name
    assert first["dgl_val"] == second["dgl_val"]
