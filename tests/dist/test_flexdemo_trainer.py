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
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero.flexdemo.checkpoint import META_FILE, rank_file
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.flexdemo.sharding import local_tensor
from lightning_hetero.replication import ReplicationSettings
from lightning_hetero.strategies.flexdemo.fabric import FlexDeMoStrategy as FabricFlexDeMoStrategy
from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy
from lightning_hetero.testing import run_distributed
from tests.fixtures import Recorder, TinyLlama, ValidatedTokenData, quiet_trainer
from tests.token_data import TINY_LLAMA, progressions

CONFIG = {**TINY_LLAMA, "tie_word_embeddings": False}
WORLD = 4
DEMO = ReplicationSettings(kind="demo")


def _data(batches: int = 1) -> ValidatedTokenData:
    """``batches`` batches of 2 per rank and epoch (the same every epoch, so resuming at an epoch end is exact)."""
    return ValidatedTokenData(2 * WORLD * batches, batch_size=2, val_count=2 * WORLD)


def _flexdemo_fields(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """dtypes, this rank's parameter shards, the converted optimizer and the schedule's learning rate."""
    optimizer = trainer.optimizers[0]
    return {
        "state_dtypes": sorted({str(v.dtype) for st in optimizer.state.values() for v in st.values() if v.dim()}),
        "param_dtypes": sorted({str(p.dtype) for p in pl_module.parameters()}),
        "params": {n: local_tensor(p).detach().clone() for n, p in pl_module.named_parameters()},
        "optimizer_class": type(optimizer).__name__,
        "scheduler_lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr(),
        "optimizer_lr": optimizer.param_groups[0]["lr"],
    }


def _recorder(checkpoint: Path | None = None) -> Recorder:
    """Losses, comm metrics and the final state (in memory); saves a checkpoint at step 3."""
    return Recorder(
        checkpoint=checkpoint,
        save_at=3,
        series={"launched": ("comm/launched_early", None)},
        fields=_flexdemo_fields,
        keep=("optimizer", "metrics"),  # the sharded state comes as local shards, in "params"
    )


def _fit(
    strategy: FlexDeMoStrategy,
    max_steps: int,
    recorder: Recorder,
    ckpt_path: Path | None = None,
    batches: int = 1,
    **trainer_kwargs: Any,
) -> None:
    trainer_kwargs.setdefault("limit_val_batches", 0)  # validation only where asked for (it costs an ulp on CPU)
    trainer = quiet_trainer(
        devices=WORLD, strategy=strategy, max_steps=max_steps, callbacks=[recorder], **trainer_kwargs
    )
    trainer.fit(TinyLlama(step_schedule=True), _data(batches), ckpt_path=ckpt_path)


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
    fabric = Fabric(
        accelerator="cpu",
        devices=WORLD,
        strategy=FabricFlexDeMoStrategy(settings=FlexDeMoSettings(replication=DEMO, shard_size=2)),
    )
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
        return FlexDeMoStrategy(
            settings=FlexDeMoSettings(
                replication=ReplicationSettings(kind="demo", kept_fraction=1 / 8), shard_size=2, drift_check_every=2
            )
        )

    straight = _recorder()
    _fit(strategy(), 6, straight)
    _fit(strategy(), 3, _recorder(checkpoint))
    resumed = _recorder()
    _fit(strategy(), 6, resumed, ckpt_path=checkpoint)
    accumulated = _recorder()
    _fit(strategy(), 2, accumulated, batches=2, accumulate_grad_batches=2, precision="bf16-mixed")
    clipped = _recorder()
    _fit(strategy(), 2, clipped, gradient_clip_val=0.5, limit_val_batches=1, val_check_interval=1)
    return {
        "straight": straight.record,
        "resumed": resumed.record,
        "accumulated_launched": accumulated.series["launched"],
        "accumulated": accumulated.record,
        "clipped": clipped.record,
        "clipped_launched": clipped.series["launched"],
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
        assert straight["metrics"]["comm/inter/bytes_sent_step"] > 0
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spawned_two_rank_fit_returns_full_weights_to_the_main_process(tmp_path):
    """start_method="spawn" from the main process: one node of 2 FSDP2 shards; rank 0 hands back unsharded weights."""
    module = TinyLlama(step_schedule=True)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    strategy = FlexDeMoStrategy(
        settings=FlexDeMoSettings(replication=ReplicationSettings(kind="full")), start_method="spawn"
    )
    trainer = quiet_trainer(
        devices=2, strategy=strategy, max_steps=6, limit_val_batches=0, callbacks=[Recorder(tmp_path, keep=())]
    )
    trainer.fit(module, _data())
    for name, value in module.named_parameters():
        assert value.shape == before[name].shape and not isinstance(value, torch.distributed.tensor.DTensor), name
        assert not torch.equal(value, before[name]), name  # the trained weights came back
    for rank in range(2):
        losses = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)["losses"]
        assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
