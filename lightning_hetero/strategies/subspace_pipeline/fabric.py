"""``SubspacePipelineStrategy`` for Fabric: the subspace pipeline in your own training loop.

The work is done by :class:`~lightning_hetero.subspace_pipeline.runtime.SubspacePipelineRuntime`, shared with the
Trainer strategy; this module decides when it runs. Usage::

    settings = SubspacePipelineSettings(pipeline=PipelineSettings(num_stages=2), dim_ratio=16, n_microbatches=4)
    strategy = SubspacePipelineStrategy(settings=settings)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(model)  # an HF Llama (or a module holding one) -> this rank's stage
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))  # build it AFTER setup_module
    for batch in fabric.setup_dataloaders(loader):  # every stage of a replica reads the same batches
        loss = strategy.train_step(batch)  # forward + backward of every microbatch; the loss on every rank
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # one norm over all stages
        optimizer.step()  # (+ the subspace update every update_every steps)
        optimizer.zero_grad()

``fabric.backward`` is not used (the schedule runs backward itself). ``strategy.eval_step(batch)`` is the
forward-only pass; ``fabric.save``/``fabric.load`` write and read a folder with one file per stage;
``strategy.export_dense(path)`` writes a plain HF checkpoint of the whole model.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import _PATH, Optimizable
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hetero.strategies.pipeline_common import PipelineFabricStrategy
from lightning_hetero.subspace_pipeline.runtime import SubspacePipelineRuntime
from lightning_hetero.subspace_pipeline.settings import DEFAULT_SETTINGS, SubspacePipelineSettings

__all__ = ["SubspacePipelineStrategy"]


class SubspacePipelineStrategy(PipelineFabricStrategy[SubspacePipelineSettings]):
    """Fabric strategy: pipeline-parallel HF Llama-family training with ``k`` numbers per token at stage boundaries."""

    settings_class = SubspacePipelineSettings
    runtime_class = SubspacePipelineRuntime

    fp16_mixed_refusal = (
        "SubspacePipelineStrategy does not support precision='16-mixed' (a loss scaler per stage cannot see the "
        "pipeline's loss). Use 'bf16-mixed', 'bf16-true' or '32-true'."
    )
    backward_refusal = (
        "With SubspacePipelineStrategy, fabric.backward() is not used: strategy.train_step(batch) runs the "
        "forward and backward of every microbatch through the pipeline and returns the loss."
    )

    def __init__(self, settings: SubspacePipelineSettings = DEFAULT_SETTINGS, **kwargs: Any) -> None:
        """Takes a :class:`SubspacePipelineSettings`; ``**kwargs`` are Lightning's arguments (see the base class)."""
        super().__init__(settings, **kwargs)

    @property
    def steps(self) -> int:
        """Optimizer steps so far (drives ``update_every``; saved by ``fabric.save``)."""
        return self.runtime.steps

    # ------------------------------------------------------------------------------------------------ public
    def train_step(self, batch: Any) -> Tensor:
        """Forward and backward of every microbatch of ``batch``; returns the loss (the same on every rank).

        Gradients are added to ``.grad`` of the stage parameters, already averaged over replicas (and projected in
        ``mode="projected"``). The loss is the mean token cross-entropy of the shifted labels (``labels``, default
        ``input_ids``; -100 ignored), or ``module.pipeline_loss(logits, microbatch)`` averaged over microbatches
        when the set-up module defines it.
        """
        with self.precision.forward_context():
            return self.runtime.train_step(batch, self._require_module())

    def eval_step(self, batch: Any) -> Tensor:
        """Forward-only pass; returns the batch loss (the same on every rank)."""
        with self.precision.forward_context():
            return self.runtime.eval_step(batch, self._require_module())

    def export_dense(self, path: _PATH, tokenizer: Any | None = None) -> str | None:
        """Write the whole model as a plain HF checkpoint (collective: every rank calls it; rank 0 writes)."""
        result = self.runtime.export_dense(str(path), tokenizer)
        self.barrier()
        return result

    # ------------------------------------------------------------------------------------------------ training
    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        step_optimizer = optimizer if isinstance(optimizer, Optimizer) else None
        self.runtime.after_optimizer_step(step_optimizer, self.runtime.steps + 1)
        return output
