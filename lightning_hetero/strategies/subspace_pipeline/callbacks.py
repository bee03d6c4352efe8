"""The subspace pipeline's callbacks: the stable rank of projection matrices, and the plain HF export.

:class:`SubspaceRankMonitor` logs the stable rank ``||W||_F^2 / ||W||_2^2`` (between 1 and ``rank(W)``), a smooth
proxy of how many directions a matrix really uses. The Protocol Models / Subspace Networks paper motivates confining
``o_proj``/``down_proj`` to a shared low-dimensional subspace by the collapse of this number during ordinary training;
the monitor measures it for any model, pipeline or not. :class:`SubspaceDenseExport` writes the trained subspace
pipeline as one plain HF checkpoint when ``fit`` ends.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from typing_extensions import override

from lightning_hetero.callbacks.comm_monitor import log_step_metrics

__all__ = ["SubspaceDenseExport", "SubspaceRankMonitor", "stable_rank"]


def stable_rank(weight: Tensor) -> float:
    """``||W||_F^2 / ||W||_2^2`` of a matrix (0 for a zero matrix), computed in float32 or wider."""
    matrix = weight.detach()
    if matrix.dtype not in (torch.float32, torch.float64):
        matrix = matrix.float()
    spectral = torch.linalg.matrix_norm(matrix, ord=2)
    if spectral == 0:
        return 0.0
    return float(torch.linalg.matrix_norm(matrix, ord="fro") ** 2 / spectral**2)


def _matrix_of(module: nn.Module) -> Tensor | None:
    """The matrix whose singular values are the layer's: ``weight``, or ``weight_coords`` for ``W = U Z`` (U has
    orthonormal columns, so ``U Z`` and ``Z`` share their nonzero singular values)."""
    for name in ("weight_coords", "weight"):
        tensor = getattr(module, name, None)
        if isinstance(tensor, Tensor) and tensor.dim() == 2 and tensor.device.type != "meta":
            return tensor
    return None


class SubspaceRankMonitor(Callback):
    """Log ``subspace/stable_rank/<module name>`` for every matching projection matrix every ``every_n_steps`` steps.

    Modules are matched by a regular expression searched in their fully-qualified name inside the LightningModule
    (default: attention output and MLP down projections: Llama-family ``o_proj``/``down_proj``, GPT-2 ``c_proj``).
    Use e.g. ``r"(q_proj|k_proj|v_proj|o_proj|up_proj|gate_proj|down_proj)$"`` for all of them. Also logs
    ``subspace/stable_rank/mean``. In a pipeline each rank sees only its own stage's layers (other stages' are
    meta tensors or absent, and skipped); Lightning's loggers write rank 0's values.

    Values go to ``trainer.callback_metrics`` (via ``self.log``, ``logger=False``) and straight to the loggers at the
    0-based index of the optimizer step just finished (so skipped steps do not repeat old values).

    Args:
        every_n_steps: Log after every n-th optimizer step (counting from the first).
        name_pattern: Regular expression matched (``re.search``) against module names.
        prog_bar: Also show the mean in the progress bar.
    """

    def __init__(
        self, every_n_steps: int = 50, name_pattern: str = r"(o_proj|down_proj|c_proj)$", prog_bar: bool = False
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"SubspaceRankMonitor(every_n_steps={every_n_steps!r}) must be an int >= 1.")
        try:
            self.pattern = re.compile(name_pattern)
        except re.error as error:
            raise ValueError(
                f"SubspaceRankMonitor(name_pattern={name_pattern!r}) is not a valid regex: {error}"
            ) from None
        self.every_n_steps = every_n_steps
        self.prog_bar = prog_bar
        self._step_at_batch_start = 0

    def compute(self, module: nn.Module) -> dict[str, float]:
        """``{metric name: stable rank}`` for every matching matrix of ``module`` (plus the mean), now."""
        values: dict[str, float] = {}
        for name, sub in module.named_modules():
            if not name or not self.pattern.search(name):
                continue
            matrix = _matrix_of(sub)
            if matrix is not None:
                values[f"subspace/stable_rank/{name}"] = stable_rank(matrix)
        if values:
            values["subspace/stable_rank/mean"] = sum(values.values()) / len(values)
        return values

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_at_batch_start:
            return  # gradient accumulation: no optimizer step yet
        finished_step = self._step_at_batch_start
        if (finished_step + 1) % self.every_n_steps:
            return
        with torch.no_grad():
            metrics = self.compute(pl_module)
        log_step_metrics(
            pl_module, metrics, finished_step, prog_bar=lambda name: self.prog_bar and name.endswith("/mean")
        )


class SubspaceDenseExport(Callback):
    """Write the trained pipeline as one plain HF checkpoint when ``fit`` ends (every rank joins; rank 0 writes).

    ``transformers.AutoModelForCausalLM.from_pretrained(dirpath)`` then loads a standard model (U folded into the
    weights, T_fixed added to the embedding) whose logits equal the pipeline's.

    Args:
        dirpath: Output directory.
        save_tokenizer: Also save ``trainer.datamodule.tokenizer`` when the datamodule has one.
    """

    def __init__(self, dirpath: str, save_tokenizer: bool = True) -> None:
        self.dirpath = str(dirpath)
        self.save_tokenizer = bool(save_tokenizer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_hetero.strategies.subspace_pipeline.trainer import (
            SubspacePipelineStrategy,
        )  # lazy: the CLI imports this module

        strategy = trainer.strategy
        if not isinstance(strategy, SubspacePipelineStrategy):
            name = type(strategy).__name__
            raise TypeError(f"SubspaceDenseExport needs Trainer(strategy=SubspacePipelineStrategy(...)), got {name}.")
        datamodule = getattr(trainer, "datamodule", None)
        tokenizer = getattr(datamodule, "tokenizer", None) if self.save_tokenizer else None
        path = strategy.export_dense(self.dirpath, tokenizer=tokenizer)
        if path is not None:
            print(f"SubspaceDenseExport: plain HF checkpoint written to {path}")
