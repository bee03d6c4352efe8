"""A training progress bar that says how fast and how long from the first step on: tokens/s, s/step and an ETA.

Lightning's bar shows tqdm's smoothed ``it/s`` of the epoch, which reads ``0.00it/s`` while a step takes minutes
(a 135M-parameter fine-tune on CPU) and estimates the end of the epoch, not of ``max_steps``.
:class:`ThroughputProgressBar` replaces it with numbers read on a monotonic wall clock from the start of the first
training batch: ``tok/s`` (tokens of this process's batches per second; ``samples/s`` for batches without token
ids), ``s/step`` (wall-clock seconds per optimizer step, validation included) and ``eta`` (the remaining optimizer
steps of the fit at that pace). All three are shown after the first step ends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lightning_hetero.callbacks.eval_report import batch_size_of
from lightning_hetero.comm.timing import wall_clock

__all__ = ["ThroughputProgressBar", "format_eta", "tokens_in"]


def tokens_in(batch: Any, token_key: str = "input_ids") -> int | None:
    """Tokens in a batch: the ``attention_mask``'s ones when it has one, else ``batch[token_key].numel()``.

    None when the batch has no token ids (e.g. images): the bar then counts samples.
    """
    if not isinstance(batch, Mapping) or token_key not in batch:
        return None
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == batch[token_key].shape:
        return int(mask.sum())
    return int(batch[token_key].numel())


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` (``?`` when unknown, e.g. an endless fit)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class ThroughputProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar with ``tok/s``, ``s/step`` and ``eta`` from the first step on (see the module docstring).

    Counts this process's batches (rank 0 draws the bar). Add it to the Trainer's callbacks; it replaces the default
    bar (LightningCLI YAML: ``- class_path: lightning_hetero.callbacks.ThroughputProgressBar``).

    Args:
        refresh_rate: Update the bar every this many batches.
        process_position: tqdm's position (several bars in one terminal).
        leave: Keep the finished epoch's bar on screen.
        token_key: Batch key of the token ids.
    """

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    """tqdm's own rate and remaining time are left out: they describe the epoch's batches, smoothed, and read
    ``0.00it/s`` for slow steps; the postfix carries ours."""

    def __init__(
        self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False, token_key: str = "input_ids"
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        if not isinstance(token_key, str) or not token_key:
            raise ValueError(f"ThroughputProgressBar(token_key={token_key!r}): name the batch key of the token ids.")
        self.token_key = token_key
        self.started_at: float | None = None
        """Wall-clock reading at the start of this fit's first training batch."""
        self.first_step = 0
        """``trainer.global_step`` at that moment (a resumed fit starts above 0)."""
        self.units = 0
        """Tokens (or samples) of the batches started since then."""
        self.unit = "tok"
        self._finished: tuple[float, int, int] | None = None  # (elapsed, steps, units) at the last optimizer step

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.started_at, self.units, self._finished = None, 0, None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.started_at is None:
            self.started_at, self.first_step = wall_clock(), trainer.global_step
        tokens = tokens_in(batch, self.token_key)
        self.unit = "tok" if tokens is not None else "samples"
        self.units += tokens if tokens is not None else batch_size_of(batch)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        steps = trainer.global_step - self.first_step
        if self.started_at is not None and steps > 0:
            self._finished = (wall_clock() - self.started_at, steps, self.units)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def throughput(self, trainer: Trainer) -> dict[str, str]:
        """The bar's ``{unit}/s``, ``s/step`` and ``eta`` as shown (empty before the first optimizer step ends)."""
        if self._finished is None:
            return {}
        elapsed, steps, units = self._finished
        per_step = elapsed / steps
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        remaining = float(total) - trainer.global_step
        rate = units / elapsed if elapsed > 0 else float("nan")
        return {
            f"{self.unit}/s": f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}",
            "s/step": f"{per_step:.3g}",
            "eta": format_eta(max(remaining, 0.0) * per_step),
        }

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        return {**self.throughput(trainer), **super().get_metrics(trainer, pl_module)}
