"""``LayerwiseStrategy`` for the Lightning Trainer: decoupled greedy layerwise training (DGL), forward-only pipeline.

Each rank trains one block of the model found inside the user's LightningModule (HF Llama family, GPT-2, ViT, or a
CNN as ``nn.Sequential``; split by :func:`lightning_hetero.layerwise.blocks.split_into_blocks`) with its own local
loss, and sends its detached output to the next stage; nothing travels backwards. The work is done by
:class:`~lightning_hetero.layerwise.dgl_runtime.DecoupledRuntime`; this adapter decides when it runs:

- ``_configure_launcher`` (in ``Trainer(...)``): the world size is checked against ``num_stages * data_parallel_size``.
- ``setup``: the model inside the module is replaced by this rank's stage (block + local head; the stem on stage 0)
  before the optimizers, so ``configure_optimizers`` sees only the stage's parameters.
- ``training_step``: the stage's DGL step (input, block, send, local loss, backward); ``train/loss`` is this stage's
  own loss (an auxiliary loss before the last stage, the model's loss on it), logged without any collective. The
  gradients are put aside and back around Lightning's ``zero_grad``, as in the subspace pipeline strategy.
- ``validation_step``/``test_step``: a forward-only pass through every stage; ``val/loss`` (the model's loss,
  broadcast from the last stage) on every rank.
- checkpoints: a folder with ``stage_<s>.pt`` per stage plus ``meta.json``, restored after setup.

The module's own ``training_step``/``validation_step`` are not called. Manual optimization is not supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hetero import comm
from lightning_hetero.core import runtime_arguments
from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
from lightning_hetero.strategies.lifecycle import TrainerStrategyBase

__all__ = ["LayerwiseStrategy"]

METRICS_LABEL = "metrics"


class LayerwiseStrategy(TrainerStrategyBase):
    """Decoupled greedy layerwise training: one block per stage, local losses, activations sent forward only.

    Args:
        num_stages: Pipeline stages (one block each); the world must have ``num_stages * data_parallel_size`` ranks.
        boundaries: Unit indices (layers / conv stages) at which stages 1.. start; default: balanced.
        data_parallel_size: Replicas of every stage; a stage's gradients are averaged over its replicas.
        aux_head: Local head of the stages before the last: ``"linear"``, ``"mlp"`` or ``"lm_head"``.
        aux_outputs: Outputs of the auxiliary heads (None: the model's classes / vocabulary).
        mode: ``"sync"`` or ``"async"`` (bounded replay buffer; stages never wait for fresh activations while they
            hold some less than ``replay_capacity`` steps old).
        replay_capacity: Replay buffer entries (asynchronous mode).
        max_in_flight: Outstanding sends before a stage waits for the link.
        activation_dtype: ``"fp32"``, ``"bf16"`` or ``"int8"`` activations on the wire.
        **kwargs: Lightning's arguments (``accelerator``, ``precision_plugin``, ``process_group_backend``,
            ``timeout``, ``start_method``, ...); see :class:`~lightning_hetero.strategies.TrainerStrategyBase`.
    """

    strategy_name = "layerwise"

    def __init__(
        self,
        num_stages: int = 2,
        boundaries: Sequence[int] | None = None,
        data_parallel_size: int = 1,
        aux_head: str = "linear",
        aux_outputs: int | None = None,
        mode: str = "sync",
        replay_capacity: int = 4,
        max_in_flight: int = 2,
        activation_dtype: str = "fp32",
        **kwargs: Any,
    ) -> None:
        super().__init__(DecoupledRuntime(**runtime_arguments(DecoupledRuntime, locals())), **kwargs)
        self._stashed_grads: list[tuple[nn.Parameter, Tensor]] = []

    @property
    def stage_index(self) -> int:
        """This rank's stage (from ``setup`` on)."""
        return self.runtime.stage_index

    @property
    def stage(self) -> nn.Module:
        """This rank's stage container (from ``setup`` on)."""
        return self.runtime.stage

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: L.Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"LayerwiseStrategy does not support accumulate_grad_batches={trainer.accumulate_grad_batches}: each "
                "stage steps on every batch it trains on. Raise the batch size and set accumulate_grad_batches=1."
            )
        if isinstance(self.precision_plugin, MixedPrecision) and getattr(self.precision_plugin, "scaler", None):
            raise ValueError("LayerwiseStrategy does not support precision='16-mixed'; use 'bf16-mixed' or '32-true'.")
        if trainer.lightning_module is not None and not trainer.lightning_module.automatic_optimization:
            raise ValueError("LayerwiseStrategy runs each stage's step itself; use automatic optimization.")
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.runtime.setup(self.model, self.root_device, self.global_rank)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._use_runtime_clipping()  # each stage clips by its own norm (no cross-stage collective)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model  # no DDP wrapper: ranks hold different stages

    @override
    def configure_ddp(self) -> None:
        pass

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return self.runtime.sampler_kwargs(self.global_rank)

    # ------------------------------------------------------------------------------------------------ training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        batch = args[0] if args else kwargs.get("batch")
        for param in module.parameters():
            param.grad = None
        with self.precision_plugin.train_step_context():
            loss = self.runtime.train_step(batch)
        # Lightning zeroes gradients between training_step and backward: keep them aside until backward.
        self._stashed_grads = [(p, p.grad) for p in module.parameters() if p.grad is not None]
        for param, _ in self._stashed_grads:
            param.grad = None
        size = _batch_size(batch)
        module.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=size)
        module.log(f"train/stage{self.stage_index}_loss", loss, on_step=True, on_epoch=False, batch_size=size)
        if self.runtime.mode == "async":
            module.log("train/staleness", float(self.runtime.last_staleness), on_step=True, batch_size=size)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        for param, grad in self._stashed_grads:
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._stashed_grads = []
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("val", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test", *args, **kwargs)

    def _evaluate(self, stage: str, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        assert module is not None
        batch = args[0] if args else kwargs.get("batch")
        self.runtime.flush()
        context = self.precision_plugin.val_step_context if stage == "val" else self.precision_plugin.test_step_context
        with context():
            loss = self.runtime.eval_step(batch)
        module.log(f"{stage}/loss", loss, prog_bar=True, on_epoch=True, sync_dist=True, batch_size=_batch_size(batch))
        return loss

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Metric reduction over the world through the counted collectives (label ``"metrics"``)."""
        if not isinstance(tensor, Tensor) or self.world_size == 1:
            return tensor
        name = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
        op = {"mean": "avg", "avg": "avg", "sum": "sum", "max": "max", "min": "min"}.get(name)
        if op is None:
            raise ValueError(f"LayerwiseStrategy.reduce: unsupported reduce_op {reduce_op!r}.")
        result = tensor.detach().clone()
        if op == "avg" and not result.is_floating_point():
            result = result.float()
        comm.all_reduce(result, op, label=METRICS_LABEL, group=group)
        return result

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("LayerwiseStrategy does not run predict; gather the stages and use a plain strategy.")


def _batch_size(batch: Any) -> int:
    for value in batch.values() if isinstance(batch, dict) else batch:
        if isinstance(value, Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1
