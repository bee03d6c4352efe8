"""FlexDeMoStrategy in a single-process Trainer (the degenerate layout: one copy, one shard) on the reference module.

Runs in the pytest process (one rank: Lightning launches nothing). Covers the Trainer adapter: the reference module's
AdamW + warmup/cosine schedule converted and re-pointed, validation through the strategy, the sharded checkpoint
layout with one rank, and a resume that is bit-identical to an uninterrupted fit.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_hetero.flexdemo.checkpoint import META_FILE, rank_file
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.models import CausalLMModule
from lightning_hetero.replication import ReplicationSettings
from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy
from tests.fixtures import Recorder, ValidatedTokenData, quiet_trainer
from tests.token_data import TINY_LLAMA


def _data() -> ValidatedTokenData:
    """One batch of arithmetic progressions mod VOCAB per epoch (the same every epoch).

    One batch per epoch keeps the resume check about what the strategy restores: where Lightning re-enters an epoch
    after an end-of-epoch checkpoint is its data-loop bookkeeping, not ours.
    """
    return ValidatedTokenData(8, batch_size=8)


def _final(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    return {
        "params": {name: p.detach().clone() for name, p in pl_module.named_parameters()},
        "optimizer": type(trainer.optimizers[0]).__name__,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "scheduler_optimizer": trainer.lr_scheduler_configs[0].scheduler.optimizer is trainer.optimizers[0],
    }


def _recorder(checkpoint: Path | None = None) -> Recorder:
    """Losses and final state (in memory); with ``checkpoint``, saves there at the end of the epoch reaching step 4."""
    return Recorder(checkpoint=checkpoint, fields=_final, keep=())


def _module() -> CausalLMModule:
    torch.manual_seed(0)
    return CausalLMModule(preset="llama-tiny", config=TINY_LLAMA, learning_rate=1e-2, warmup_steps=2, min_lr_ratio=0.5)


def _trainer(max_steps: int, recorder: Recorder, root: Path) -> L.Trainer:
    return quiet_trainer(
        devices=1,
        strategy=FlexDeMoStrategy(settings=FlexDeMoSettings(replication=ReplicationSettings(kind="full"))),
        max_steps=max_steps,
        limit_val_batches=0,  # validation between steps perturbs CPU numerics by an ulp, with stock DDP too
        callbacks=[recorder],
        default_root_dir=root,
    )


@pytest.mark.timeout(300)
def test_single_process_fit_validate_and_bit_identical_resume(tmp_path):
    checkpoint = tmp_path / "step4.ckpt"
    straight = _recorder(checkpoint)
    trainer = _trainer(8, straight, tmp_path)
    module = _module()
    trainer.fit(module, _data())
    assert straight.record["optimizer"] == "DecoupledAdamW"
    assert straight.record["scheduler_optimizer"]
    assert sum(straight.losses[-2:]) / 2 < straight.losses[0] - 0.3, straight.losses
    assert trainer.callback_metrics["comm/inter/bytes_sent_step"] == 0
    evaluator = L.Trainer(
        accelerator="cpu", devices=1, strategy=FlexDeMoStrategy(), logger=False, enable_progress_bar=False
    )
    (metrics,) = evaluator.validate(module, _data(), verbose=False)  # a validate-only run of the strategy
    assert metrics["val/loss"] < straight.losses[0]

    assert sorted(p.name for p in checkpoint.iterdir()) == sorted(
        [META_FILE, META_FILE + ".sha256", rank_file(checkpoint, 0).name, rank_file(checkpoint, 0).name + ".sha256"]
    )
    saved = torch.load(rank_file(checkpoint, 0), weights_only=False)
    assert "replicator" in saved["optimizer_states"][0]  # the replicator's state travels with the optimizer

    resumed = _recorder()
    _trainer(8, resumed, tmp_path).fit(_module(), _data(), ckpt_path=checkpoint)
    assert resumed.losses == straight.losses[4:]
    assert resumed.record["lr"] == straight.record["lr"]
    for name, value in straight.record["params"].items():
        assert torch.equal(value, resumed.record["params"][name]), name


def test_meta_of_another_layout_is_read_and_a_damaged_one_refused(tmp_path):
    from lightning_hetero.core import CorruptCheckpointError
    from lightning_hetero.flexdemo.checkpoint import make_meta, read_meta, write_meta
    from lightning_hetero.flexdemo.topology import Topology

    checkpoint = tmp_path / "ckpt"
    write_meta(checkpoint, torch.nn.Linear(2, 2), Topology(world_size=4, rank=0, shard_size=2))
    here = Topology(world_size=2, rank=0, shard_size=2)  # another layout: re-cut on load (flexdemo/reshard.py)
    assert read_meta(checkpoint, here, "FlexDeMoStrategy")["world_size"] == 4
    (checkpoint / META_FILE).write_bytes((checkpoint / META_FILE).read_bytes()[:-4])
    with pytest.raises(CorruptCheckpointError, match="meta.pt"):
        read_meta(checkpoint, here, "FlexDeMoStrategy")
    torch.save({**make_meta(torch.nn.Linear(2, 2), here), "world_size": 3}, checkpoint / META_FILE)
    (checkpoint / (META_FILE + ".sha256")).unlink()  # written before checksums: loads unchecked
    with pytest.raises(ValueError, match="world_size=3, shard_size=2: damaged"):
        read_meta(checkpoint, here, "FlexDeMoStrategy")
    with pytest.raises(ValueError, match="is not a FlexDeMo sharded checkpoint"):
        read_meta(tmp_path, Topology(world_size=1, rank=0, shard_size=1), "FlexDeMoStrategy")


def _fit_user_llama(strategy: Any, tmp_path: Path) -> tuple[L.Trainer, list[float], list[str]]:
    from tests.usercode.usernets import UserLlama

    recorder = Recorder(keep=())
    trainer = quiet_trainer(
        devices=1,
        strategy=strategy,
        max_steps=6,
        limit_val_batches=0,
        callbacks=[recorder],
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(UserLlama(train_items=64))
    return trainer, recorder.losses, [str(w.message) for w in caught]


@pytest.mark.timeout(300)
def test_bare_flexdemo_on_one_node_does_not_compress(tmp_path, caplog):
    """``strategy="flexdemo"`` (the registered name, no arguments) on one copy: dense "full" updates, no warning."""
    import lightning_hetero  # noqa: F401  (registers the name)

    with caplog.at_level(logging.INFO):
        trainer, losses, messages = _fit_user_llama("flexdemo", tmp_path)
    assert trainer.optimizers[0].replicator.name == "full"
    assert not any("single model copy" in message for message in messages), messages
    assert "replicator='full' (no compression" in caplog.text
    assert losses[-1] < losses[0], losses


@pytest.mark.timeout(300)
def test_explicit_replicator_on_one_node_is_kept_with_the_warning(tmp_path):
    settings = FlexDeMoSettings(replication=ReplicationSettings(kind="demo"), adamw_exchange="gradient")
    trainer, losses, messages = _fit_user_llama(FlexDeMoStrategy(settings=settings), tmp_path)
    assert trainer.optimizers[0].replicator.name == "demo"
    assert {group["exchange"] for group in trainer.optimizers[0].param_groups} == {"gradient"}  # the setting reached it
    assert any("single model copy" in message for message in messages), messages
