"""``SubspacePipelineStrategy`` for the Lightning Trainer: pipeline parallelism whose boundaries carry k numbers/token.

Each rank runs one stage of an HF Llama-family model found inside the user's LightningModule (stage-major layout:
global rank ``r`` runs stage ``r // data_parallel_size`` of replica ``r % data_parallel_size``; see
:class:`~lightning_hetero.pipeline.settings.PipelineSettings`). The strategy owns
the schedule; the module's own ``training_step``/``validation_step`` are not called (see below).

How it plugs into the Trainer (a ``DDPStrategy`` for the launcher and process group, without the DDP wrapper):

- ``_configure_launcher`` (in ``Trainer(...)``): the world size is checked against
  ``settings.pipeline.num_stages * settings.pipeline.data_parallel_size``.
- ``setup``: the HF model inside the module is replaced by this rank's stage (after ``configure_model``, before the
  optimizers, so ``configure_optimizers`` sees only the stage's parameters); unsupported settings are refused here.
- ``training_step``: the whole schedule (forward and backward of every microbatch) runs here, under the precision
  context; the loss, computed on the last stage and broadcast, is logged as ``train/loss`` on every rank and
  returned. The gradients are moved aside, because Lightning's automatic optimization calls ``zero_grad`` *after*
  ``training_step``; ``backward`` puts them back. ``train/loss`` is therefore the real loss, and clipping
  (``gradient_clip_val``, one norm over all stages) and ``optimizer.step`` see the real gradients.
- ``optimizer_step``: after the step, the subspace update every ``update_every`` steps.
- ``validation_step``/``test_step``: a forward-only pass; ``val/loss``/``test/loss`` logged on every rank.
- checkpoints: a folder with one file per stage plus ``meta.json``
  (:mod:`lightning_hetero.subspace_pipeline.checkpoint`), restored after setup into the stage modules.

With ``automatic_optimization = False`` the module's ``training_step`` runs instead, and calls
``self.trainer.strategy.train_step(batch)`` (forward + backward, returns the loss) before its own optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hetero.strategies.pipeline_common import PipelineTrainerStrategy
from lightning_hetero.subspace_pipeline.pipeline import split_batch
from lightning_hetero.subspace_pipeline.runtime import SubspacePipelineRuntime
from lightning_hetero.subspace_pipeline.settings import DEFAULT_SETTINGS, SubspacePipelineSettings

__all__ = ["SubspacePipelineStrategy"]


class SubspacePipelineStrategy(PipelineTrainerStrategy[SubspacePipelineSettings]):
    """Pipeline-parallel training of an HF Llama-family model whose stage boundaries carry ``k`` numbers per token.

    Every layer whose output crosses a boundary writes only into a shared ``k``-dim subspace span(U), and a frozen
    seed-derived table ``T_fixed`` is added to the token embedding, so each boundary sends ``k`` coordinates per
    token (forward) and receives ``k``-dim gradients (backward), losslessly. ``compress=False`` runs the plain model
    through the same pipeline (``d`` numbers per token).
    """

    settings_class = SubspacePipelineSettings
    runtime_class = SubspacePipelineRuntime

    fp16_mixed_refusal = (
        "SubspacePipelineStrategy does not support precision='16-mixed' (a loss scaler per stage cannot see "
        "the pipeline's loss). Use 'bf16-mixed', 'bf16-true' or '32-true'."
    )
    manual_backward_refusal = (
        "With SubspacePipelineStrategy, manual_backward() is not used: strategy.train_step(batch) runs the "
        "forward and backward of every microbatch; call optimizer.step() after it."
    )
    accumulation_refusal = (
        "the pipeline already accumulates gradients over its microbatches. Raise n_microbatches and the batch size "
        "instead, and set accumulate_grad_batches=1."
    )
    predict_refusal = (
        "SubspacePipelineStrategy does not run predict: export the model (strategy.export_dense(path)) and "
        "predict with a plain strategy."
    )

    def __init__(self, settings: SubspacePipelineSettings = DEFAULT_SETTINGS, **kwargs: Any) -> None:
        """Takes a :class:`SubspacePipelineSettings`; ``**kwargs`` are Lightning's arguments (see the base class)."""
        super().__init__(settings, **kwargs)

    # ------------------------------------------------------------------------------------------------ public
    def train_step(self, batch: Any) -> Tensor:
        """Forward and backward of every microbatch (manual optimization); returns the loss, the same on every rank."""
        return self.runtime.train_step(batch, self.lightning_module)

    def eval_step(self, batch: Any) -> Tensor:
        """Forward-only pass; returns the batch loss, the same on every rank."""
        return self.runtime.eval_step(batch, self.lightning_module)

    def export_dense(self, path: _PATH, tokenizer: Any | None = None) -> str | None:
        """Write the whole model as a plain HF checkpoint (collective: call on every rank; rank 0 writes)."""
        result = self.runtime.export_dense(str(path), tokenizer)
        self.barrier("SubspacePipelineStrategy.export_dense")
        return result

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def _train_batch(self, batch: Any, module: L.LightningModule) -> Tensor:
        return self.runtime.train_step(batch, module)

    @override
    def _eval_batch(self, batch: Any, module: L.LightningModule) -> Tensor:
        return self.runtime.eval_step(batch, module)

    @override
    def _batch_size(self, batch: Any) -> int:
        chunks = split_batch(batch, 1)
        return int(chunks[0]["input_ids"].shape[0])

    # ------------------------------------------------------------------------------------------------ training
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: L.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        steps_done = self._global_step() + 1  # global_step counts after this hook
        self.runtime.after_optimizer_step(optimizer, steps_done)
        return output
