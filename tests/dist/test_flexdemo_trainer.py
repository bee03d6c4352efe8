"""FlexDeMoStrategy end to end in the Trainer and in Fabric, 2 simulated nodes x 2 ranks (4 spawned gloo ranks).

The Trainer and Fabric run inside :func:`run_distributed` workers: the process group exists already (Lightning sees
``LOCAL_RANK`` and launches nothing), so one spawn runs several fits: an uninterrupted 6-step fit, a 3-step fit that
saves a sharded checkpoint, a fresh fit resumed from it to step 6 (bitwise equal parameters and optimizer state),
a fit with gradient accumulation, and a Fabric loop with ``fabric.save``/``fabric.load``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero.flexdemo.checkpoint import META_FILE, rank_file
from lightning_hetero.flexdemo.sharding import local_tensor
from lightning_hetero.strategies.flexdemo.fabric import FlexDeMoStrategy as FabricFlexDeMoStrategy
from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy
from lightning_hetero.testing import run_distributed
from tests.token_data import VOCAB, progressions

CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
WORLD = 4


class TokenData(L.LightningDataModule):
    """``batches`` batches of 2 per rank and epoch (the same every epoch, so resuming at an epoch end is exact)."""

    def __init__(self, batches: int = 1) -> None:
        super().__init__()
        self.batches = batches

    def train_dataloader(self) -> DataLoader:
        return DataLoader(progressions(2 * WORLD * self.batches), batch_size=2, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(progressions(2 * WORLD), batch_size=2, shuffle=False)


class TinyLlama(L.LightningModule):
    """A user's LightningModule: HF model built in ``__init__``, torch AdamW + a step LR schedule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**CONFIG))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.model(**batch).loss, sync_dist=True)  # root parameters gathered by the strategy

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Recorder(Callback):
    """Collects losses and comm metrics; saves a checkpoint at step ``save_at``; keeps the final state."""

    def __init__(self, checkpoint: Path | None = None, save_at: int = 3) -> None:
        self.checkpoint, self.save_at = checkpoint, save_at
        self.losses: list[float] = []
        self.launched: list[float] = []
        self.final: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        if "comm/launched_early" in trainer.callback_metrics:
            self.launched.append(float(trainer.callback_metrics["comm/launched_early"]))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.checkpoint is not None and trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.checkpoint)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        self.final = {
            "state_dtypes": sorted({str(v.dtype) for st in optimizer.state.values() for v in st.values() if v.dim()}),
            "param_dtypes": sorted({str(p.dtype) for p in pl_module.parameters()}),
            "params": {n: local_tensor(p).detach().clone() for n, p in pl_module.named_parameters()},
            "optimizer": optimizer.state_dict(),
            "optimizer_class": type(optimizer).__name__,
            "scheduler_lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr(),
            "optimizer_lr": optimizer.param_groups[0]["lr"],
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        }


def _fit(
    strategy: FlexDeMoStrategy,
    max_steps: int,
    recorder: Recorder,
    ckpt_path: Path | None = None,
    batches: int = 1,
    **trainer_kwargs: Any,
) -> None:
    trainer_kwargs.setdefault("limit_val_batches", 0)  # validation only where asked for (it costs an ulp on CPU)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    trainer.fit(TinyLlama(), TokenData(batches), ckpt_path=ckpt_path)


def _same(first: Any, second: Any) -> bool:
    """Recursive equality of nested dicts/lists of tensors and plain values (tensors bitwise)."""
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and first.dtype == second.dtype and torch.equal(first, second)
    if isinstance(first, dict):
        return (
            isinstance(second, dict)
            and first.keys() == second.keys()
            and all(_same(first[k], second[k]) for k in first)
        )
    if isinstance(first, (list, tuple)):
        return len(first) == len(second) and all(_same(a, b) for a, b in zip(first, second, strict=True))
    return first == second


def _fabric_loop(out: Path) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=FabricFlexDeMoStrategy(replicator="demo", shard_size=2))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(LlamaForCausalLM(LlamaConfig(**CONFIG)))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=3e-3))
    loader = fabric.setup_dataloaders(DataLoader(progressions(8 * WORLD), batch_size=2, shuffle=False))
    batches = list(loader)

    def step(batch: dict[str, torch.Tensor]) -> float:
        half = {key: value[:1] for key, value in batch.items()}
        with fabric.no_backward_sync(model, enabled=True):  # an accumulation micro-batch: nothing launched
            fabric.backward(model(**half).loss * 0.5)
        loss = model(**batch).loss
        fabric.backward(loss * 0.5)  # the final micro-batch launches every block's exchange
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    losses = [step(batch) for batch in batches[:4]]
    fabric.save(out / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 4})
    losses += [step(batch) for batch in batches[4:]]
    final = {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()}
    remainder = fabric.load(out / "fabric.ckpt", {"model": model, "optimizer": optimizer})
    again = [step(batch) for batch in batches[4:]]
    return {
        "optimizer_class": type(optimizer.optimizer).__name__,
        "losses": losses,
        "again": again,
        "replayed": all(
            torch.equal(value, local_tensor(p)) for (_, value), p in zip(final.items(), model.parameters(), strict=True)
        ),
        "remainder": remainder,
        "metrics": fabric.strategy.last_comm_metrics,
        "shards": {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()},
    }


def _worker(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    checkpoint = out / "step3.ckpt"

    def strategy() -> FlexDeMoStrategy:
        return FlexDeMoStrategy(replicator="demo", compression=1 / 8, shard_size=2, drift_check_every=2)

    straight = Recorder()
    _fit(strategy(), 6, straight)
    _fit(strategy(), 3, Recorder(checkpoint))
    resumed = Recorder()
    _fit(strategy(), 6, resumed, ckpt_path=checkpoint)
    accumulated = Recorder()
    _fit(strategy(), 2, accumulated, batches=2, accumulate_grad_batches=2, precision="bf16-mixed")
    clipped = Recorder()
    _fit(strategy(), 2, clipped, gradient_clip_val=0.5, limit_val_batches=1, val_check_interval=1)
    return {
        "straight": {"losses": straight.losses, **straight.final},
        "resumed": {"losses": resumed.losses, **resumed.final},
        "accumulated_launched": accumulated.launched,
        "accumulated": accumulated.final,
        "clipped": clipped.final,
        "clipped_launched": clipped.launched,
        "checkpoint_files": sorted(p.name for p in checkpoint.iterdir()),
        "fabric": _fabric_loop(out),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, tmp_path_factory.mktemp("flexdemo"), timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_trainer_trains_and_converts_adamw(runs):
    for result in runs:
        straight = result["straight"]
        assert straight["optimizer_class"] == "DecoupledAdamW"
        assert sum(straight["losses"][-2:]) / 2 < straight["losses"][0] - 0.3, straight["losses"]
        # The scheduler, re-pointed at the converted optimizer, stepped 6 times and set its lr.
        assert straight["scheduler_lr"] == [pytest.approx(1e-2 / 7)]
        assert straight["optimizer_lr"] == pytest.approx(1e-2 / 7)
        assert straight["metrics"]["comm/inter_bytes_sent"] > 0
        assert 0.0 <= straight["metrics"]["comm/hidden_fraction"] <= 1.0
    for shard in range(2):
        for name, value in runs[shard]["straight"]["params"].items():
            assert torch.equal(value, runs[shard + 2]["straight"]["params"][name]), name


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_trainer_resume_is_bit_identical(runs):
    assert runs[0]["checkpoint_files"] == sorted(
        [
            META_FILE,
            META_FILE + ".sha256",
            *(name for r in range(WORLD) for name in (rank_file(".", r).name, rank_file(".", r).name + ".sha256")),
        ]
    )
    for rank, result in enumerate(runs):
        straight, resumed = result["straight"], result["resumed"]
        assert resumed["losses"] == straight["losses"][3:], rank
        for name, value in straight["params"].items():
            assert torch.equal(value, resumed["params"][name]), (rank, name)
        assert _same(straight["optimizer"], resumed["optimizer"]), rank  # momentum, error feedback, replicator state


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_trainer_accumulation_clipping_validation_and_bf16(runs):
    params = len(runs[0]["straight"]["params"])
    for result in runs:
        # Each step launched every parameter during its final micro-batch (a launch on the first micro-batch would
        # have made the second one fail: a parameter cannot be launched twice in a step).
        assert result["accumulated_launched"] and set(result["accumulated_launched"]) == {params}
        assert result["clipped_launched"] == [0.0, 0.0]  # clipping needs the node norm first: no early launch
        assert "val/loss" in result["clipped"]["metrics"]  # validation ran through the sharded root
        # bf16-mixed: FSDP2 computes in bf16, the sharded parameters and every optimizer state stay fp32.
        assert result["accumulated"]["param_dtypes"] == ["torch.float32"]
        assert result["accumulated"]["state_dtypes"] == ["torch.float32"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_fabric_loop_converts_accumulates_and_resumes(runs):
    for result in runs:
        fabric = result["fabric"]
        assert fabric["optimizer_class"] == "DeMoSGD"
        assert fabric["losses"][-1] < fabric["losses"][0]
        assert fabric["again"] == fabric["losses"][4:]
        assert fabric["replayed"]
        assert fabric["remainder"] == {"step": 4}
        assert fabric["metrics"]["comm/launched_early"] == len(fabric["shards"])
    for shard in range(2):
        for name, value in runs[shard]["fabric"]["shards"].items():
            assert torch.equal(value, runs[shard + 2]["fabric"]["shards"][name]), name


class LossRecorder(Callback):
    """Writes each rank's losses (the spawned ranks' callbacks are copies: results come back through files)."""

    def __init__(self, out: Path) -> None:
        self.out, self.losses = out, []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(self.losses, self.out / f"losses{trainer.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spawned_two_rank_fit_returns_full_weights_to_the_main_process(tmp_path):
    """start_method="spawn" from the main process: one node of 2 FSDP2 shards; rank 0 hands back unsharded weights."""
    module = TinyLlama()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    strategy = FlexDeMoStrategy(replicator="full", start_method="spawn")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=6,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LossRecorder(tmp_path)],
    )
    trainer.fit(module, TokenData())
    for name, value in module.named_parameters():
        assert value.shape == before[name].shape and not isinstance(value, torch.distributed.tensor.DTensor), name
        assert not torch.equal(value, before[name]), name  # the trained weights came back
    for rank in range(2):
        losses = torch.load(tmp_path / f"losses{rank}.pt")
        assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
