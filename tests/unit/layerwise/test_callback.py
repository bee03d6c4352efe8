"""GreedyLayerwise with a plain Trainer: stage changes re-point the optimizer, export, resume, errors before step 1."""

from __future__ import annotations

import pytest
import torch
from lightning import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from transformers import AutoModelForImageClassification

from lightning_hetero.layerwise import SplitMismatchError
from lightning_hetero.models.image_classifier import ImageClassifierModule
from lightning_hetero.strategies.layerwise.callbacks import GreedyLayerwise
from tests.unit.layerwise.helpers import TINY_VIT, tiny_batch

DATA = tiny_batch("vit", rows=16, seed=3)
ROWS = [{"pixel_values": DATA["pixel_values"][i], "labels": DATA["labels"][i], "index": i} for i in range(16)]


def _module() -> ImageClassifierModule:
    torch.manual_seed(0)
    return ImageClassifierModule("vit-tiny", config=TINY_VIT, warmup_steps=1, learning_rate=1e-2)


def _fit(module, callback, max_steps, ckpt_path=None, extra=(), checkpointing=False) -> Trainer:
    torch.manual_seed(1)  # the auxiliary heads' initialisation
    trainer = Trainer(
        max_steps=max_steps, callbacks=[callback, *extra], accelerator="cpu", logger=False,
        enable_checkpointing=checkpointing, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, DataLoader(ROWS, batch_size=4), ckpt_path=ckpt_path)
    return trainer


class _StepCounter(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args) -> None:
        self.steps += 1


class _RecordOptimizer(Callback):
    """After GreedyLayerwise's hook: the stage and the ids of the parameters the optimizer holds, per step."""

    def __init__(self, greedy: GreedyLayerwise) -> None:
        self.greedy, self.seen = greedy, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        held = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        active = {id(p) for p in self.greedy.stages.active_parameters()}
        self.seen.append((self.greedy.stages.stage, held == active, trainer.lr_scheduler_configs[0].scheduler))


def test_stages_advance_and_the_optimizer_holds_exactly_the_active_parameters(tmp_path):
    module = _module()
    greedy = GreedyLayerwise(stage_steps=[2, 2, 6], cache="memory", export_dir=str(tmp_path / "export"))
    recorder = _RecordOptimizer(greedy)
    _fit(module, greedy, max_steps=10, extra=[recorder])
    assert [stage for stage, _, _ in recorder.seen] == [0, 0, 1, 1] + [2] * 6
    assert all(exact for _, exact, _ in recorder.seen)
    assert len({id(scheduler) for _, _, scheduler in recorder.seen}) == 3  # one schedule per stage
    assert greedy.cache.stats()["hits"] == 2  # stage 2's second epoch starts with two batches it has seen
    # the export is an ordinary HF model with the trained weights; the auxiliary heads are not part of it
    reloaded = AutoModelForImageClassification.from_pretrained(tmp_path / "export").eval()
    module.model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(pixel_values=DATA["pixel_values"]).logits, module.model(**_inputs()).logits)
    assert set(reloaded.state_dict()) == set(module.model.state_dict())
    assert all(p.requires_grad for p in module.parameters())


def _inputs() -> dict[str, torch.Tensor]:
    return {"pixel_values": DATA["pixel_values"]}


def test_resume_mid_stage_equals_the_uninterrupted_run(tmp_path):
    straight = _module()
    # the uninterrupted run writes a checkpoint at step 4 (an epoch boundary, inside stage 1 of steps 3-5)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    trainer = _fit(straight, GreedyLayerwise(stage_steps=3), max_steps=8, extra=[saver], checkpointing=True)
    checkpoint = tmp_path / "step=4.ckpt"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 4
    assert trainer.global_step == 8
    resumed = _module()
    greedy = GreedyLayerwise(stage_steps=3)
    _fit(resumed, greedy, max_steps=8, ckpt_path=checkpoint)
    assert greedy.stages.stage == 2
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_resume_with_another_split_fails_before_step_one(tmp_path):
    trainer = _fit(_module(), GreedyLayerwise(stage_steps=3), max_steps=4)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    counter = _StepCounter()
    with pytest.raises(SplitMismatchError, match="split 'vit:3:0-1,1-2,2-3'.*configured with split 'vit:3:0-2,2-3'"):
        _fit(_module(), GreedyLayerwise(3, num_blocks=2), 8, ckpt_path=tmp_path / "mid.ckpt", extra=[counter])
    assert counter.steps == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"aux_head": "mlp", "keep_last_aux_head": True}, "keep_last_aux_head=True needs"),
        ({"stage_steps": [2, 2]}, "stage_steps has 2 entries but the split has 3 blocks"),
        ({"num_blocks": 5}, "num_blocks=5 does not fit the model's 3 layers"),
    ],
)
def test_bad_configuration_fails_before_step_one(kwargs, message):
    counter = _StepCounter()
    with pytest.raises(ValueError, match=message):
        _fit(_module(), GreedyLayerwise(**{"stage_steps": 2, **kwargs}), max_steps=4, extra=[counter])
    assert counter.steps == 0


def test_callback_arguments_are_checked():
    with pytest.raises(ValueError, match="stage_steps=0 must be a positive int"):
        GreedyLayerwise(stage_steps=0)
    with pytest.raises(ValueError, match="needs a directory"):
        GreedyLayerwise(cache="disk")
