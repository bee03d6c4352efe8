"""``LayerwiseStrategy`` for the Lightning Trainer: decoupled greedy layerwise training (DGL), forward-only pipeline.

Each rank trains one block of the model found inside the user's LightningModule (HF Llama family, GPT-2, ViT, or a
CNN as ``nn.Sequential``; split by :func:`lightning_hetero.layerwise.blocks.split_into_blocks`) with its own local
loss, and sends its detached output to the next stage; nothing travels backwards. The work is done by
:class:`~lightning_hetero.layerwise.dgl_runtime.DecoupledRuntime`; this adapter decides when it runs:

- ``_configure_launcher`` (in ``Trainer(...)``): the world size is checked against
  ``settings.pipeline.num_stages * settings.pipeline.data_parallel_size``.
- ``setup``: the model inside the module is replaced by this rank's stage (block + local head; the stem on stage 0)
  before the optimizers, so ``configure_optimizers`` sees only the stage's parameters.
- ``training_step``: the stage's DGL step (input, block, send, local loss, backward); ``train/stage<s>_loss`` is this
  stage's own loss (an auxiliary loss before the last stage), logged without any collective. ``train/loss`` is the
  model's loss, as in every other strategy: the last stage's, logged there and on global rank 0 (where the progress
  bar and the loggers are), which receives it each step without blocking either side, so there it lags by the steps
  in flight (:mod:`~lightning_hetero.layerwise.loss_report`); ranks that know neither log no ``train/loss``. The
  gradients are put aside and back around Lightning's ``zero_grad``, as in the subspace pipeline strategy.
- ``validation_step``/``test_step``: a forward-only pass through every stage; ``val/loss`` (the model's loss,
  broadcast from the last stage) on every rank.
- checkpoints: a folder with ``stage_<s>.pt`` per stage plus ``meta.json``, restored after setup.
- ``settings.export_dir``: when fit ends, the whole model is gathered to rank 0 and written there as an ordinary
  model, as ``GreedyLayerwise(export_dir=...)`` does (HF: ``save_pretrained``; CNN: ``model.pt``); :meth:`export`
  does it on demand.

The module's own ``training_step``/``validation_step`` are not called. Manual optimization is not supported. The
shared pipeline-adapter part (no DDP wrapper, gradients put aside around ``zero_grad``, metric reduction) is
:class:`~lightning_hetero.strategies.pipeline_common.PipelineTrainerStrategy`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
from lightning_hetero.layerwise.settings import DEFAULT_SETTINGS, LayerwiseSettings
from lightning_hetero.strategies.pipeline_common import PipelineTrainerStrategy

__all__ = ["LayerwiseStrategy"]


class LayerwiseStrategy(PipelineTrainerStrategy[LayerwiseSettings]):
    """Decoupled greedy layerwise training: one block per stage, local losses, activations sent forward only."""

    settings_class = LayerwiseSettings
    runtime_class = DecoupledRuntime

    fp16_mixed_refusal = "LayerwiseStrategy does not support precision='16-mixed'; use 'bf16-mixed' or '32-true'."
    manual_backward_refusal = "LayerwiseStrategy runs each stage's step itself; use automatic optimization."
    predict_refusal = "LayerwiseStrategy does not run predict; gather the stages and use a plain strategy."
    accumulation_refusal = (
        "each stage steps on every batch it trains on. Raise the batch size and set accumulate_grad_batches=1."
    )

    def __init__(self, settings: LayerwiseSettings = DEFAULT_SETTINGS, **kwargs: Any) -> None:
        """Takes a :class:`LayerwiseSettings`; ``**kwargs`` are Lightning's arguments (see the base class)."""
        super().__init__(settings, **kwargs)

    @override
    def teardown(self) -> None:
        if getattr(self, "_interrupted", False):
            self.runtime.loss_report.abandon()  # the last stage may be gone: wait for none of its loss messages
        super().teardown()

    def export(self, path: str | Path) -> str | None:
        """Write the whole trained model to ``path`` (collective: call on every rank; rank 0 writes and gets
        ``path``, the others None). See :meth:`DecoupledRuntime.export`."""
        result = self.runtime.export(path)
        self.barrier("LayerwiseStrategy.export")
        return result

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.settings.export_dir is not None:
            path = self.export(self.settings.export_dir)
            if path is not None:
                rank_zero_info(f"LayerwiseStrategy: trained model written to {path}")

    @override
    def _check_trainer(self, trainer: L.Trainer) -> None:
        super()._check_trainer(trainer)
        if trainer.lightning_module is not None and not trainer.lightning_module.automatic_optimization:
            raise ValueError(self.manual_backward_refusal)

    @override
    def _train_batch(self, batch: Any, module: L.LightningModule) -> Tensor:
        return self.runtime.train_step(batch)

    @override
    def _before_evaluation(self) -> None:
        self.runtime.flush()

    @override
    def _eval_batch(self, batch: Any, module: L.LightningModule) -> Tensor:
        return self.runtime.eval_step(batch)

    @override
    def _log_training(self, module: L.LightningModule, loss: Tensor, batch: Any) -> None:
        size = self._batch_size(batch)
        # An auxiliary loss must not pass for the model's (docs/metrics.md): it goes under the stage's name, and
        # train/loss is the model's loss (the last stage's) wherever it is known.
        own = f"train/stage{self.stage_index}_loss"
        module.log(own, loss, prog_bar=not self.runtime.is_last, on_step=True, on_epoch=False, batch_size=size)
        model_loss = self.runtime.model_loss
        if model_loss is not None:
            module.log("train/loss", model_loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=size)
        if self.settings.mode == "async":
            module.log("train/staleness", float(self.runtime.last_staleness), on_step=True, batch_size=size)
