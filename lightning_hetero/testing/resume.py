"""Mid-epoch resume check for every strategy: stop at step 7 of a 20-step epoch, resume, compare with a straight run.

One case runs inside :func:`~lightning_hetero.testing.run_distributed` ranks (the process group exists, so the
Trainer launches nothing) and does three fits of a tiny model on shuffled data served by
:class:`~lightning_hetero.data.stateful.StatefulDataLoader` (the Trainer injects its ``DistributedSampler``):

1. straight: ``steps`` steps (exactly one epoch);
2. stopped: the same fit, checkpointed at ``stop`` (mid-epoch) and stopped there;
3. resumed: a fresh Trainer and module from that checkpoint up to ``steps``.

Each rank then compares its final parameters (its local shard where sharded), optimizer state (moments, error
feedback, replicator state where the strategy keeps it there) and the strategy's extra checkpoint state (codec
error-feedback buffers, subspace bases, ...) of the straight and resumed fits, bit for bit, plus the order of the
batches it trained on. Used by ``tests/dist/test_midepoch_resume.py`` and ``recipes/reliability/reliability_resume.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero.data.stateful import StatefulDataLoader

VOCAB = 64
LLAMA = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}


def _strategy(case: str) -> Any:
    """The strategy of ``case`` (built inside the rank: strategies are not shared between fits)."""
    if case.startswith("flexdemo"):
        from lightning_hetero.flexdemo.settings import FlexDeMoSettings
        from lightning_hetero.replication.settings import ReplicationSettings
        from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy

        if case == "flexdemo/diloco":
            diloco = ReplicationSettings(kind="diloco", sync_every=3, outer_lr=0.8, outer_momentum=0.5)
            return FlexDeMoStrategy(settings=FlexDeMoSettings(replication=diloco, shard_size=1))
        demo = ReplicationSettings(kind="demo", kept_fraction=1 / 8)
        return FlexDeMoStrategy(settings=FlexDeMoSettings(replication=demo, shard_size=1, drift_check_every=4))
    if case == "matformer/mixed-tiers":
        from lightning_hetero.matformer.settings import MatFormerSettings
        from lightning_hetero.replication.settings import ReplicationSettings
        from lightning_hetero.strategies.matformer.trainer import MatFormerStrategy

        replication = ReplicationSettings(kept_fraction=0.25)
        return MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1], mode="demo", replication=replication))
    if case == "subspace/pipeline":
        from lightning_hetero.pipeline.settings import PipelineSettings
        from lightning_hetero.strategies.subspace_pipeline.trainer import SubspacePipelineStrategy
        from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings

        settings = SubspacePipelineSettings(
            pipeline=PipelineSettings(num_stages=2), subspace_dim=8, n_microbatches=2, update_every=3
        )
        return SubspacePipelineStrategy(settings=settings)
    if case == "sparseflip/low-bit":
        from lightning_hetero.sparseflip.settings import FlipSettings, FpSyncSettings, SparseFlipSettings
        from lightning_hetero.strategies.sparseflip.trainer import SparseFlipStrategy

        settings = SparseFlipSettings(
            flip=FlipSettings(max_per_step=16, bop_gamma=0.3),
            fp_sync=FpSyncSettings(kept_fraction=0.25),
            drift_check_every=4,
        )
        return SparseFlipStrategy(settings=settings)
    raise ValueError(f"Unknown resume case {case!r}; pick one of {sorted(CASES)}.")


CASES: dict[str, dict[str, Any]] = {
    # replicas: how many data-parallel replicas share the data (the DistributedSampler's num_replicas).
    "flexdemo/demo": {"replicas": 2, "batch": 2, "model": "llama"},
    "flexdemo/diloco": {"replicas": 2, "batch": 2, "model": "llama"},
    "matformer/mixed-tiers": {"replicas": 2, "batch": 2, "model": "llama"},
    "subspace/pipeline": {"replicas": 1, "batch": 4, "model": "llama-tied"},  # both stages see the same batches
    "sparseflip/low-bit": {"replicas": 2, "batch": 8, "model": "mlp"},
}
"""Every resume case: ``strategy/variant`` -> data and model settings. Each runs on 2 ranks."""


def token_rows(count: int, length: int = 12, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``count`` distinct arithmetic progressions mod VOCAB (seeded); the first token identifies a row's batch."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (count,), generator=generator)
    strides = torch.randint(1, 5, (count,), generator=generator)
    ids = (starts[:, None] + torch.arange(length)[None] * strides[:, None]) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _features(count: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(count, 16, generator=generator)
    return TensorDataset(x, x[:, :4].argmax(dim=1).long())


class ResumeData(L.LightningDataModule):
    """``steps`` batches per replica and epoch, shuffled by a StatefulDataLoader (seeded, resumable)."""

    def __init__(self, case: str, steps: int) -> None:
        super().__init__()
        settings = CASES[case]
        self.batch = settings["batch"]
        count = steps * settings["batch"] * settings["replicas"]
        self.dataset: Any = _features(count) if settings["model"] == "mlp" else token_rows(count)

    def train_dataloader(self) -> DataLoader:
        return StatefulDataLoader(self.dataset, batch_size=self.batch, shuffle=True, seed=7, drop_last=True)


class ResumeModule(L.LightningModule):
    """A tiny HF Llama (or an MLP for the low-bit case) with AdamW and a per-step LR schedule."""

    def __init__(self, model: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = model
        if model == "mlp":
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        else:
            from transformers import LlamaConfig, LlamaForCausalLM

            self.model = LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=model == "llama-tied"))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kind == "mlp":
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
        else:
            loss = self.model(**batch).loss
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _local(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.detach().clone().cpu()
    if isinstance(value, dict):
        return {key: _local(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_local(item) for item in value]
    return value


class _Record(Callback):
    """Records the batches trained on; optionally checkpoints at ``stop`` and stops; keeps the final state."""

    def __init__(self, checkpoint: Path | None = None, stop: int = 0) -> None:
        self.checkpoint, self.stop = checkpoint, stop
        self.batches: list[list[float]] = []
        self.final: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any) -> None:
        first = batch["input_ids"][:, 0] if isinstance(batch, dict) else batch[0][:, 0]
        self.batches.append(first.tolist())

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.checkpoint is not None and trainer.global_step == self.stop:
            trainer.save_checkpoint(self.checkpoint)  # what ModelCheckpoint(every_n_train_steps=stop) does here
            trainer.should_stop = True  # the run dies here; schedules still planned for the full run

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        runtime = getattr(strategy, "runtime", None)
        extra = runtime.extra_checkpoint_state(strategy.root_device) if runtime is not None else None  # collective
        self.final = {
            "params": {name: _local(p) for name, p in pl_module.named_parameters()},
            "buffers": {name: _local(b) for name, b in pl_module.named_buffers()},
            "optimizer": _local(trainer.optimizers[0].state_dict()),
            "scheduler": _local(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            "extra": _local(extra),
        }


def _fit(case: str, steps: int, record: _Record, ckpt_path: Path | None = None) -> None:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_strategy(case),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[record],
    )
    module, data = ResumeModule(CASES[case]["model"]), ResumeData(case, steps)
    trainer.fit(module, data, ckpt_path=ckpt_path, weights_only=True)  # the loader state is plain ints


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_leaves(item, f"{prefix}/{key}"))
        return out
    if isinstance(value, (list, tuple)):
        out = {}
        for index, item in enumerate(value):
            out.update(_leaves(item, f"{prefix}/{index}"))
        return out
    return {prefix: value}


def compare_states(first: Any, second: Any) -> tuple[bool, float, list[str]]:
    """Bitwise comparison of two nested states: (equal, max |difference| over float tensors, differing leaves)."""
    left, right = _leaves(first), _leaves(second)
    differing = sorted(set(left) ^ set(right))
    max_diff = 0.0
    for key in sorted(set(left) & set(right)):
        a, b = left[key], right[key]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            if a.shape == b.shape and a.is_floating_point() and b.is_floating_point() and a.numel():
                max_diff = max(max_diff, float((a.double() - b.double()).abs().max()))
        else:
            same = type(a) is type(b) and a == b
        if not same:
            differing.append(key)
    return not differing, max_diff, differing


def resume_case(rank: int, world_size: int, case: str, out: Path, stop: int = 7, steps: int = 20) -> dict[str, Any]:
    """Body of one rank (for ``run_distributed``): straight vs stopped-and-resumed fits of ``case``; its verdict."""
    checkpoint = out / f"{case.replace('/', '-')}-step{stop}.ckpt"
    straight, stopped, resumed = _Record(), _Record(checkpoint, stop), _Record()
    _fit(case, steps, straight)
    _fit(case, steps, stopped)
    _fit(case, steps, resumed, ckpt_path=checkpoint)
    equal, max_diff, differing = compare_states(straight.final, resumed.final)
    return {
        "case": case,
        "rank": rank,
        "equal": equal,
        "max_abs_diff": max_diff,
        "differing": differing[:10],
        # What was compared: tensors and plain values per part (extra: the strategy's own checkpoint state).
        "compared": {part: len(_leaves(value)) if value is not None else 0 for part, value in straight.final.items()},
        "same_batches": stopped.batches + resumed.batches == straight.batches,
        "stopped_at": len(stopped.batches),
        "resumed_steps": len(resumed.batches),
        # The order would be wrong with a plain loader: the resumed run would start the epoch over.
        "restart_would_differ": straight.batches[:13] != straight.batches[stop:],
    }
