"""``LayerwiseStrategy`` for Fabric: decoupled greedy layerwise training (DGL) in your own loop.

The work is done by :class:`~lightning_hetero.layerwise.dgl_runtime.DecoupledRuntime`, shared with the Trainer
strategy. Usage::

    strategy = LayerwiseStrategy(settings=LayerwiseSettings(pipeline=PipelineSettings(num_stages=2)))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(model)  # a module holding the HF model / CNN -> this rank's stage
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))  # build it AFTER setup_module
    for batch in fabric.setup_dataloaders(loader):  # every stage of a replica reads the same batches
        loss = strategy.train_step(batch)  # this stage's local loss; its backward already ran
        optimizer.step()
        optimizer.zero_grad()
    strategy.flush()  # before the end (and before evaluating or saving; fabric.save does it)

``fabric.backward`` is not used. ``strategy.eval_step(batch)`` is the forward-only pass through every stage (the
model's loss on every rank); ``fabric.save``/``fabric.load`` write and read a folder with one file per stage.
``strategy.export(path)`` (every rank calls it) writes the whole trained model as an ordinary model, as
``GreedyLayerwise(export_dir=...)`` does (HF ``save_pretrained``; a CNN: ``model.pt``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
from lightning_hetero.layerwise.settings import DEFAULT_SETTINGS, LayerwiseSettings
from lightning_hetero.strategies.pipeline_common import PipelineFabricStrategy

__all__ = ["LayerwiseStrategy"]


class LayerwiseStrategy(PipelineFabricStrategy[LayerwiseSettings]):
    """Fabric strategy: one block per stage, local losses, activations sent forward only."""

    settings_class = LayerwiseSettings
    runtime_class = DecoupledRuntime

    fp16_mixed_refusal = "LayerwiseStrategy does not support precision='16-mixed'; use 'bf16-mixed' or '32-true'."
    backward_refusal = (
        "With LayerwiseStrategy, fabric.backward() is not used: strategy.train_step(batch) runs this stage's "
        "forward, local loss and backward, and returns the loss."
    )

    def __init__(self, settings: LayerwiseSettings = DEFAULT_SETTINGS, **kwargs: Any) -> None:
        """Takes a :class:`LayerwiseSettings`; ``**kwargs`` are Lightning's arguments (see the base class)."""
        super().__init__(settings, **kwargs)

    def train_step(self, batch: Any) -> Tensor:
        """This stage's DGL step (gradients land in ``.grad``, averaged over replicas); returns its local loss."""
        self._require_module()
        with self.precision.forward_context():
            return self.runtime.train_step(batch)

    def eval_step(self, batch: Any) -> Tensor:
        """Forward-only pass through every stage; the model's loss on every rank."""
        self._require_module()
        self.runtime.flush()
        with self.precision.forward_context():
            return self.runtime.eval_step(batch)

    def export(self, path: str | Path) -> str | None:
        """Write the whole trained model to ``path`` (collective: call on every rank; rank 0 writes and gets
        ``path``, the others None). See :meth:`DecoupledRuntime.export`."""
        self._require_module()
        result = self.runtime.export(path)
        self.barrier()
        return result

    @property
    def model_loss(self) -> float | None:
        """The model's training loss: the last stage's own; on global rank 0 the newest one the last stage has sent
        (it lags by the steps in flight); None elsewhere."""
        return self.runtime.model_loss

    def flush(self) -> None:
        """Finish the activations in flight (call at the end of training; evaluation and saving do it)."""
        self.runtime.flush()
