"""Validation loss/perplexity before and after ``fit``, printed side by side.

Lightning's sanity check runs a couple of validation batches before training but does not log them; fine-tuning
users want the number they started from. :class:`ValidationReport` evaluates the validation set (or its first
``limit_batches`` batches) when fit starts and when it ends, and prints both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class ValidationReport(Callback):
    """Evaluate validation loss and perplexity at the start and end of ``fit`` and print both.

    Works with any LightningModule whose ``forward(**batch)`` returns an object with a ``.loss`` (every HF model,
    and our reference modules). The loss is averaged over batches weighted by batch size; perplexity is
    ``exp(loss)``. Every rank evaluates its full (unsharded) validation loader, so sharded strategies whose forward
    needs all ranks still work; rank 0 prints.

    Args:
        limit_batches: Evaluate only the first this many validation batches (None: all).
        perplexity: Also report ``exp(loss)`` (set False for classifiers).
    """

    def __init__(self, limit_batches: int | None = 20, perplexity: bool = True) -> None:
        if limit_batches is not None and limit_batches < 1:
            raise ValueError(f"ValidationReport(limit_batches={limit_batches}): use a positive int or None for all.")
        self.limit_batches = limit_batches
        self.perplexity = perplexity
        self.before: float | None = None
        self.after: float | None = None
        self._restored_before = False

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> float:
        """Mean validation loss of ``pl_module`` over the datamodule's validation loader."""
        datamodule = trainer.datamodule
        if datamodule is None:
            raise RuntimeError("ValidationReport needs a LightningDataModule passed to fit(datamodule=...).")
        return mean_validation_loss(
            trainer, pl_module, datamodule.val_dataloader(), self.limit_batches, "ValidationReport"
        )

    def _describe(self, loss: float) -> str:
        text = f"loss {loss:.4f}"
        if self.perplexity:
            text += f", perplexity {math.exp(min(loss, 80.0)):.2f}"
        return text

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._restored_before:  # resumed run: "before" means before the first run, kept in the checkpoint
            self._restored_before = False
            rank_zero_info(f"[ValidationReport] before training (from checkpoint): {self._describe(self.before)}")
            return
        self.before = self.evaluate(trainer, pl_module)
        rank_zero_info(f"[ValidationReport] before training: {self._describe(self.before)}")

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.after = self.evaluate(trainer, pl_module)
        rank_zero_info(
            f"[ValidationReport] before training: {self._describe(self.before or float('nan'))}\n"
            f"[ValidationReport] after training:  {self._describe(self.after)}"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("before") is not None:
            self.before = state_dict["before"]
            self._restored_before = True


@torch.no_grad()
def mean_validation_loss(
    trainer: Trainer, pl_module: LightningModule, loader: Iterable[Any], limit: int | None, caller: str
) -> float:
    """Batch-size-weighted mean of ``pl_module(**batch).loss`` over the first ``limit`` batches of ``loader``.

    Runs in eval mode under ``torch.no_grad()`` and the precision plugin's forward context, and restores the module's
    training mode. ``caller`` names the callback in errors.
    """
    was_training = pl_module.training
    pl_module.eval()
    total, count = 0.0, 0
    try:
        with trainer.precision_plugin.forward_context():
            for index, batch in enumerate(loader):
                if limit is not None and index >= limit:
                    break
                batch = trainer.strategy.batch_to_device(batch)
                size = batch_size_of(batch, caller)
                total += float(pl_module(**batch).loss) * size
                count += size
    finally:
        pl_module.train(was_training)
    if count == 0:
        raise RuntimeError(f"{caller}: the validation loader yielded no batches.")
    return total / count


def batch_size_of(batch: Any, caller: str) -> int:
    """Examples in a dict batch (``labels`` first, as our modules weight ``val/loss``)."""
    if isinstance(batch, Mapping) and batch:
        tensor = batch.get("labels")
        if tensor is None:
            tensor = next(iter(batch.values()))
        return int(tensor.shape[0])
    raise TypeError(f"{caller} expects dict batches (the keyword arguments of the module's forward).")
