"""Lightning fixtures shared by the strategy tests: token data modules, the user's tiny Llama module, a recording
callback and a quiet Trainer (importable from spawned ranks as ``tests.fixtures``).

Spawned ranks get pickled copies of the callbacks, so :class:`Recorder` hands results back through a file per rank
when given ``out``; in-process ranks (``run_distributed`` workers, one process) read ``Recorder.record`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero import comm
from tests.token_data import TINY_LLAMA, progressions

Fields = Callable[[L.Trainer, L.LightningModule], dict[str, Any]]
"""A test's own record fields, computed at the end of training (a module-level function: it is pickled by name)."""


class TokenData(L.LightningDataModule):
    """``count`` progressions in batches of ``batch_size``, unshuffled: the same batches every epoch, so a resumed run
    sees what the uninterrupted one saw whatever Lightning does when it re-enters an epoch. Training data only."""

    def __init__(self, count: int, batch_size: int) -> None:
        super().__init__()
        self.count, self.batch_size = count, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(progressions(self.count), batch_size=self.batch_size, shuffle=False)


class ValidatedTokenData(TokenData):
    """:class:`TokenData` with validation data: ``val_count`` progressions (default ``count``), same batch size."""

    def __init__(self, count: int, batch_size: int, val_count: int | None = None) -> None:
        super().__init__(count, batch_size)
        self.val_count = count if val_count is None else val_count

    def val_dataloader(self) -> DataLoader:
        return DataLoader(progressions(self.val_count), batch_size=self.batch_size, shuffle=False)


class TinyLlama(L.LightningModule):
    """A user's LightningModule: an HF Llama (:data:`TINY_LLAMA`, seed 0) built in ``__init__``, logging
    ``train/loss`` and ``val/loss``, torch AdamW (lr 1e-2, weight decay 0.1).

    Args:
        tie_word_embeddings: Tie the head to the embedding.
        step_schedule: Add a per-step ``1 / (1 + step)`` LR schedule.
        hidden_size_by_rank: Build the model in ``configure_model`` instead, each rank with its own hidden size (a
            deliberately mismatched model for schema checks; untied, unseeded).
    """

    def __init__(
        self,
        tie_word_embeddings: bool = False,
        step_schedule: bool = False,
        hidden_size_by_rank: dict[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.step_schedule, self.hidden_size_by_rank = step_schedule, hidden_size_by_rank
        self.model: LlamaForCausalLM | None = None
        if hidden_size_by_rank is None:
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=tie_word_embeddings))

    def configure_model(self) -> None:
        if self.model is None:
            hidden = self.hidden_size_by_rank[self.global_rank]
            self.model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "hidden_size": hidden}))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        if not self.step_schedule:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class StrategyStepLlama(TinyLlama):
    """:class:`TinyLlama` (tied embeddings) for a strategy that runs the steps itself (pipelines): the module's own
    steps must never be called; they are defined only to switch training and validation on (Lightning's rule)."""

    def __init__(self) -> None:
        super().__init__(tie_word_embeddings=True)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        raise AssertionError("the strategy runs the step; the module's training_step is not called")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        raise AssertionError("defined only to switch validation on; the strategy runs it")


class Recorder(Callback):
    """Records each step's loss and chosen logged metrics; saves a checkpoint at the end of the epoch that reaches
    ``save_at``; at the end of training records losses, series, the standard parts named in ``keep`` and the test's
    own ``fields`` (which win over those), to ``out/rank{global_rank}.pt`` or, without ``out``, to :attr:`record`.

    Args:
        out: Folder for the per-rank record files (spawned ranks); ``None`` keeps the record in memory.
        checkpoint: Where to save at step ``save_at``; ``None`` saves nothing.
        save_at: The global step after which to save.
        stop_after_save: Stop training after the save (an interrupted run with the full run's schedules).
        series: Record name -> (logged metric, value when it is missing); a missing metric with a ``None`` default
            is skipped for that step.
        fields: The test's own record fields.
        keep: Standard parts to record: ``state`` (the module's state dict), ``optimizer`` (the first optimizer's
            state dict), ``metrics`` (the callback metrics as floats).
    """

    def __init__(
        self,
        out: Path | None = None,
        checkpoint: Path | None = None,
        save_at: int = 4,
        stop_after_save: bool = False,
        series: Mapping[str, tuple[str, float | None]] | None = None,
        fields: Fields | None = None,
        keep: Collection[str] = ("state", "optimizer", "metrics"),
    ) -> None:
        if unknown := set(keep) - {"state", "optimizer", "metrics"}:
            raise ValueError(f"keep={sorted(keep)}: unknown part(s) {sorted(unknown)}; use state, optimizer, metrics")
        self.out, self.checkpoint, self.save_at, self.stop_after_save = out, checkpoint, save_at, stop_after_save
        self.series_metrics = dict(series or {})
        self.fields, self.keep = fields, tuple(keep)
        self.losses: list[float] = []
        self.series: dict[str, list[float]] = {name: [] for name in self.series_metrics}
        self.record: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        for name, (metric, default) in self.series_metrics.items():
            if metric in trainer.callback_metrics:
                self.series[name].append(float(trainer.callback_metrics[metric]))
            elif default is not None:
                self.series[name].append(default)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.checkpoint is not None and trainer.global_step == self.save_at:  # where ModelCheckpoint would save
            trainer.save_checkpoint(self.checkpoint)
            if self.stop_after_save:
                trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record: dict[str, Any] = {"losses": self.losses, **self.series}
        if "state" in self.keep:
            record["state"] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        if "optimizer" in self.keep:
            record["optimizer"] = trainer.optimizers[0].state_dict()
        if "metrics" in self.keep:
            record["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if self.fields is not None:
            record.update(self.fields(trainer, pl_module))
        if self.out is None:
            self.record = record
        else:
            torch.save(record, self.out / f"rank{trainer.global_rank}.pt")


def pipeline_fields(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Record fields of a pipeline strategy: this rank's stage and the bytes it sent on the pipeline."""
    return {"stage": trainer.strategy.stage_index, "pipeline_bytes": comm.get_ledger().totals(comm.PIPELINE).sent}


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """A CPU Trainer without logger, checkpointing callback, progress bar or model summary; ``kwargs`` add to it."""
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def fit_ranks(
    out: Path,
    module: L.LightningModule | Callable[[], L.LightningModule],
    data: Any,
    strategy: Any,
    max_steps: int,
    checkpoint: Path | None = None,
    ckpt_path: Path | None = None,
    devices: int = 2,
    recorder: Mapping[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> list[dict[str, Any]]:
    """Fit ``module`` on ``data`` with spawned ranks (seeded 0) and return every rank's :class:`Recorder` record.

    Args:
        out: Folder for the rank records (created).
        module: The LightningModule, or a zero-argument factory of it called after seeding (its construction then
            leaves the RNG state in which the ranks start).
        data: A LightningDataModule or a train DataLoader.
        strategy: The strategy; it spawns ``devices`` ranks.
        max_steps: Trainer ``max_steps``.
        checkpoint: Where the recorder saves at step 4.
        ckpt_path: Checkpoint to resume from.
        devices: Number of ranks.
        recorder: More :class:`Recorder` keywords (``fields``, ``series``, ``stop_after_save``...).
        trainer_kwargs: More Trainer keywords.
    """
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    callback = Recorder(out, checkpoint, **(recorder or {}))
    trainer = quiet_trainer(
        devices=devices, strategy=strategy, max_steps=max_steps, callbacks=[callback], **trainer_kwargs
    )
    if not isinstance(module, L.LightningModule):
        module = module()
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(devices)]
