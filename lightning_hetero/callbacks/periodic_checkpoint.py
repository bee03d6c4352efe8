"""Periodic checkpoints that a restarted job can trust: Lightning's ``ModelCheckpoint`` plus a completion manifest.

``VerifiedCheckpoint(dirpath=..., every_n_train_steps=N)`` saves every ``N`` optimizer steps and keeps the newest
``keep`` checkpoints (two by default, so there is always a previous one to fall back to). After a save has finished
on every rank, global rank 0 writes ``<checkpoint>.manifest.json`` with every file's size and SHA-256
(:func:`lightning_hetero.reliability.write_manifest`). On (re)start, resume from
``lightning_hetero.reliability.latest_good_checkpoint(dirpath)``: the newest checkpoint with a manifest whose files
all match, so a crash during a save or a corrupted file falls back to the previous checkpoint.

A checkpoint given by path (``trainer.fit(ckpt_path=...)``) is checked against its manifest too (a warning when it
has none). lightning-hetero's strategies do it in ``load_checkpoint``, before anything of the file is unpickled.
For other strategies this callback does it in ``on_train_start``: Lightning tells callbacks the path only once the
checkpoint is loaded (``setup`` runs before the load but without the path), so the check there runs after the load
(``weights_only``, nothing executed) and before the first training step, and a damaged file stops the fit there.

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_hetero.callbacks.VerifiedCheckpoint
          init_args: {dirpath: checkpoints, every_n_train_steps: 50}
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_hetero.reliability.checkpoints import (
    checkpoint_bytes,
    remove_manifest,
    verify_resume_checkpoint,
    write_manifest,
)

__all__ = ["VerifiedCheckpoint"]


class VerifiedCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` every ``every_n_train_steps`` steps, the newest ``keep`` kept, each marked complete.

    Args:
        dirpath: Directory of the checkpoints (shared by all ranks: a shared file system across nodes).
        every_n_train_steps: Save after every this many optimizer steps (the one setting that matters).
        keep: How many of the newest checkpoints to keep (>= 2 keeps a fallback when the newest is damaged).
        filename: Checkpoint name pattern (default ``step=000123``; must contain ``{step}`` to keep names unique).
        kwargs: Anything else ``ModelCheckpoint`` takes (e.g. ``save_weights_only``).

    Attributes:
        saves: On global rank 0, one record per save: ``step``, ``seconds`` (the save on every rank, barrier
            included), ``manifest_seconds`` (hashing and writing the manifest), ``bytes``.
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_train_steps: int,
        keep: int = 2,
        filename: str = "step={step:06d}",
        **kwargs: Any,
    ) -> None:
        if int(every_n_train_steps) < 1:
            raise ValueError(f"every_n_train_steps must be >= 1, got {every_n_train_steps}.")
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1 (2 or more keeps a fallback), got {keep}.")
        if "{step" not in filename:
            raise ValueError(f"filename must contain '{{step}}' so every save gets its own name, got {filename!r}.")
        for owned in ("monitor", "mode", "save_top_k", "save_on_train_epoch_end", "auto_insert_metric_name"):
            if owned in kwargs:
                raise TypeError(f"VerifiedCheckpoint sets {owned!r} itself (it keeps the newest `keep` by step).")
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            every_n_train_steps=int(every_n_train_steps),
            monitor="step",
            mode="max",
            save_top_k=int(keep),
            save_on_train_epoch_end=False,
            auto_insert_metric_name=False,
            **kwargs,
        )
        self.saves: list[dict[str, Any]] = []

    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        start = time.perf_counter()
        super()._save_checkpoint(trainer, filepath)  # every rank; Trainer.save_checkpoint ends with a barrier
        saved = time.perf_counter()
        if trainer.is_global_zero:
            write_manifest(filepath, step=trainer.global_step, epoch=trainer.current_epoch)
            self.saves.append(
                {
                    "step": trainer.global_step,
                    "seconds": saved - start,
                    "manifest_seconds": time.perf_counter() - saved,
                    "bytes": checkpoint_bytes(filepath),
                }
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # Our strategies verified the file before loading it; stock ones did not, so do it before the first step.
        if trainer.ckpt_path is not None and not getattr(trainer.strategy, "verifies_checkpoints", False):
            verify_resume_checkpoint(trainer.ckpt_path)

    @override
    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if trainer.is_global_zero:
            remove_manifest(filepath)  # first: a half-deleted checkpoint must never look complete
        super()._remove_checkpoint(trainer, filepath)
