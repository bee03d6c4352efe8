"""Batch share end to end in the Trainer, 2 spawned gloo ranks: explicit shares ``[0.75, 0.25]`` at ``batch_size=4``
give micro-batches 6 and 2, and one step equals a single-process step on the concatenated 8 samples (FlexDeMo with
the Full replicator; MatFormer in mode mean, all tier 0); ``"auto"`` measures, agrees on every rank and stays exact;
a mid-epoch resume continues with the next micro-batches, bit-identically.

The Trainer runs inside :func:`run_distributed` workers (the process group exists, Lightning launches nothing).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero.data.stateful import StatefulDataLoader
from lightning_hetero.flexdemo.optim import DeMoSGD
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.flexdemo.sharding import local_tensor
from lightning_hetero.matformer.settings import MatFormerSettings
from lightning_hetero.replication import ReplicationSettings
from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy
from lightning_hetero.strategies.matformer.trainer import MatFormerStrategy
from lightning_hetero.testing import run_distributed
from tests.fixtures import quiet_trainer
from tests.token_data import TINY_LLAMA, progressions

WORLD = 2
SAMPLES = 16
BATCH = 4
STEP = 0.25
"""The effective step size: SGD(lr=0.25) for MatFormer; DeMoSGD(lr=0.5) with Full replication steps lr**2 x grad."""


def _items() -> list[dict[str, torch.Tensor]]:
    return [{**item, "index": torch.tensor(i)} for i, item in enumerate(progressions(SAMPLES))]


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=False))


class _ShareModule(L.LightningModule):
    """A tiny Llama that records which samples each training batch held and the validation batch sizes."""

    def __init__(self, flexdemo: bool) -> None:
        super().__init__()
        self.flexdemo = flexdemo
        self.model = _model()
        self.seen: list[list[int]] = []
        self.val_sizes: list[int] = []

    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.seen.append(batch["index"].tolist())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs = {key: value for key, value in batch.items() if key != "index"}
        loss = self.model(**inputs).loss
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_sizes.append(len(batch["index"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.flexdemo:  # Full replication exchanges the gradient; the step is lr * (lr * combined)
            return DeMoSGD(self.parameters(), lr=0.5, momentum=0.0, sign=False, replicator="full")
        return torch.optim.SGD(self.parameters(), lr=STEP)


class _SaveAtStepOne(L.Callback):
    """Save a checkpoint after the first step, mid-epoch (inside the fit, as a periodic checkpoint would)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            trainer.save_checkpoint(self.path)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "batch share" in record.getMessage():
            self.lines.append(record.getMessage())


def _fit(
    strategy: Any, flexdemo: bool, max_steps: int = 1, save: Path | None = None, resume: Path | None = None
) -> dict[str, Any]:
    module = _ShareModule(flexdemo)
    train = StatefulDataLoader(_items(), batch_size=BATCH, shuffle=True, seed=3)
    val = DataLoader(_items()[:8], batch_size=BATCH)
    callbacks = [] if save is None else [_SaveAtStepOne(save)]
    trainer = quiet_trainer(
        devices=WORLD,
        strategy=strategy,
        max_steps=max_steps,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        callbacks=callbacks,
    )
    trainer.fit(module, train, val, ckpt_path=resume)
    loader = trainer.train_dataloader
    return {
        "seen": module.seen,
        "val_sizes": module.val_sizes,
        "loader": type(loader).__name__,
        "sizes": list(loader.batch_sampler.sizes),
        "params": {name: local_tensor(p).detach().clone() for name, p in module.model.named_parameters()},
    }


def _matformer_share() -> MatFormerStrategy:
    return MatFormerStrategy(settings=MatFormerSettings(batch_share=[0.75, 0.25]))


def _worker(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    handler = _Lines()
    for name in ("lightning.pytorch", "lightning_utilities"):  # where Lightning's rank_zero_info logs
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    full = ReplicationSettings(kind="full")
    runs = {
        "flexdemo": _fit(
            FlexDeMoStrategy(settings=FlexDeMoSettings(shard_size=1, replication=full, batch_share=[0.75, 0.25])), True
        ),
        "matformer": _fit(_matformer_share(), False),
        # Mid-epoch resume: 2 steps per epoch; a checkpoint after step 1 (mid-epoch), resumed from it to step 3.
        "straight": _fit(_matformer_share(), False, max_steps=3),
        "first": _fit(_matformer_share(), False, max_steps=3, save=out / "step1.ckpt"),
        "resumed": _fit(_matformer_share(), False, max_steps=3, resume=out / "step1.ckpt"),
        "flexdemo_auto": _fit(
            FlexDeMoStrategy(settings=FlexDeMoSettings(shard_size=1, replication=full, batch_share="auto")), True
        ),
    }
    return {**runs, "lines": list(dict.fromkeys(handler.lines))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, tmp_path_factory.mktemp("batch_share"), timeout=600)


def _reference(indices: list[int]) -> dict[str, torch.Tensor]:
    """One single-process step on the concatenated batch: ``p - STEP * grad`` of the mean loss over it."""
    model = _model()
    items = _items()
    batch = {key: torch.stack([items[i][key] for i in indices]) for key in ("input_ids", "labels")}
    model(**batch).loss.backward()
    return {name: (p - STEP * p.grad).detach() for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", ["flexdemo", "matformer", "flexdemo_auto"])
def test_one_step_equals_the_step_on_the_concatenated_global_batch(runs, run):
    first, second = runs[0][run], runs[1][run]
    assert first["sizes"] == second["sizes"] and sum(first["sizes"]) == WORLD * BATCH
    if run != "flexdemo_auto":
        assert first["sizes"] == [6, 2]
    assert [len(batch) for batch in first["seen"]] == [first["sizes"][0]]
    assert [len(batch) for batch in second["seen"]] == [first["sizes"][1]]
    indices = first["seen"][0] + second["seen"][0]
    assert len(set(indices)) == WORLD * BATCH  # the ranks saw different samples
    assert first["loader"] == second["loader"] == "StatefulDataLoader"  # mid-epoch resume stays exact
    assert first["val_sizes"] and set(first["val_sizes"] + second["val_sizes"]) == {BATCH}  # validation untouched
    expected = _reference(indices)
    for result in (first, second):
        for name, value in result["params"].items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=f"{run} {name}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_mid_epoch_resume_continues_with_the_next_step(runs):
    for result in runs:
        straight, first, resumed = result["straight"]["seen"], result["first"]["seen"], result["resumed"]["seen"]
        assert len(straight) == 3 and first == straight
        assert resumed == straight[1:]  # the same micro-batches, none repeated or skipped
        for name, value in result["straight"]["params"].items():
            torch.testing.assert_close(value, result["resumed"]["params"][name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_line_per_rank_is_logged(runs):
    lines = runs[0]["lines"]
    assert any("rank 0 (node 0): micro-batch 6 of 8 (75.0%)" in line for line in lines), lines
    assert any("rank 1 (node 0): micro-batch 2 of 8 (25.0%)" in line for line in lines), lines
    assert any("samples/s" in line for line in lines), lines  # the measured run names each rank's throughput
    assert runs[1]["lines"] == []  # rank 0 logs for everyone
