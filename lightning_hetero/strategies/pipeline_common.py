"""What the pipeline adapters share: strategies whose ranks hold different stages of one model.

The subspace pipeline (``strategy="subspace_pipeline"``) and decoupled greedy layerwise training
(``strategy="layerwise"``) replace the model by this rank's stage, so they skip the DDP wrapper, shard the data by
replica only (every stage of a replica reads the same batches) and run a whole training step inside the runtime.
:class:`PipelineTrainerStrategy` and :class:`PipelineFabricStrategy` hold that part once, on top of
:mod:`lightning_hetero.strategies.lifecycle`; the strategy adapters only add their arguments, their checks of
unsupported settings, and how they call and log their runtime.

The runtime must provide ``stage_index``, ``stage``, ``sampler_kwargs(global_rank)`` and
``setup(module, device, global_rank)`` (returning the module that now holds this rank's stage).
"""

from __future__ import annotations

from typing import Any, ClassVar

import lightning as L
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hetero import comm
from lightning_hetero.strategies.lifecycle import ReplacingFabricStrategyBase, SettingsT, TrainerStrategyBase

__all__ = ["METRICS_LABEL", "PipelineFabricStrategy", "PipelineTrainerStrategy", "first_batch_dim"]

METRICS_LABEL = "metrics"
"""Ledger label of Lightning's metric reductions (``self.log(..., sync_dist=True)``) under the pipeline strategies."""

_REDUCE_OPS = {"mean": "avg", "avg": "avg", "sum": "sum", "max": "max", "min": "min"}


def first_batch_dim(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first non-scalar tensor (1 when it holds none)."""
    for value in batch.values() if isinstance(batch, dict) else batch:
        if isinstance(value, Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


class _StageViews:
    """``stage_index`` and ``stage`` of this rank, read from the runtime (valid once the module is set up)."""

    runtime: Any

    @property
    def stage_index(self) -> int:
        """This rank's stage (once the module is set up)."""
        return self.runtime.stage_index

    @property
    def stage(self) -> nn.Module:
        """This rank's stage module (once the module is set up)."""
        return self.runtime.stage


class PipelineTrainerStrategy(_StageViews, TrainerStrategyBase[SettingsT]):
    """Trainer base of the pipeline strategies: no DDP wrapper, the runtime's step inside ``training_step``.

    Subclasses implement :meth:`_check_trainer`, :meth:`_train_batch` and :meth:`_eval_batch`, and may override
    :meth:`_log_training`, :meth:`_before_evaluation` and :meth:`_batch_size`. With ``automatic_optimization =
    False`` the module's own ``training_step`` runs (it calls the strategy's ``train_step``).

    Lightning zeroes gradients between ``training_step`` and ``backward``, but the runtime's step has already run
    backward: the gradients are put aside after the step and back in ``backward``, so ``train/loss`` is the real
    loss and clipping and ``optimizer.step`` see the real gradients.
    """

    fp16_mixed_refusal: ClassVar[str] = "This strategy does not support precision='16-mixed'; use 'bf16-mixed'."
    """The error for ``precision='16-mixed'`` (a loss scaler cannot see a loss computed on another stage)."""
    manual_backward_refusal: ClassVar[str] = "manual_backward() is not used: call strategy.train_step(batch)."
    """The error for ``manual_backward`` under manual optimization."""
    predict_refusal: ClassVar[str] = "This strategy does not run predict."
    """The error of ``trainer.predict``."""
    accumulation_refusal: ClassVar[str] = "set accumulate_grad_batches=1."
    """Why ``accumulate_grad_batches`` > 1 is refused, and the fix (the end of the error)."""

    def __init__(self, settings: Any, **kwargs: Any) -> None:
        super().__init__(settings, **kwargs)
        self._stashed_grads: list[tuple[nn.Parameter, Tensor]] = []

    # ------------------------------------------------------------------------------------------------ hooks
    def _check_trainer(self, trainer: L.Trainer) -> None:
        """Refuse Trainer settings the strategy cannot honour (first thing in ``setup``, on every rank): gradient
        accumulation (the runtime's step already runs backward) and ``precision='16-mixed'``."""
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"{type(self).__name__} does not support accumulate_grad_batches={trainer.accumulate_grad_batches}: "
                f"{self.accumulation_refusal}"
            )
        self._refuse_fp16_mixed()

    def _refuse_fp16_mixed(self) -> None:
        if isinstance(self.precision_plugin, MixedPrecision) and getattr(self.precision_plugin, "scaler", None):
            raise ValueError(self.fp16_mixed_refusal)

    def _train_batch(self, batch: Any, module: L.LightningModule) -> Tensor:
        """The runtime's training step on ``batch`` (under the precision context); returns the loss to log."""
        raise NotImplementedError

    def _eval_batch(self, batch: Any, module: L.LightningModule) -> Tensor:
        """The runtime's forward-only pass on ``batch`` (under the precision context); returns the loss."""
        raise NotImplementedError

    def _before_evaluation(self) -> None:
        """Runs before each evaluation batch, outside the precision context."""

    def _log_training(self, module: L.LightningModule, loss: Tensor, batch: Any) -> None:
        module.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=self._batch_size(batch))

    def _batch_size(self, batch: Any) -> int:
        return first_batch_dim(batch)

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: L.Trainer) -> None:
        """Build this rank's stage in place of the model, then optimizers and precision (no DDP wrapper)."""
        self._check_trainer(trainer)
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
            # Stages hold disjoint parameters: the runtime defines the norm gradient_clip_val clips by.
            self._use_runtime_clipping()

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
        if not module.automatic_optimization:
            return super().training_step(*args, **kwargs)
        batch = args[0] if args else kwargs.get("batch")
        # The step adds to .grad, and the previous step's gradients are still there (Lightning zeroes them only
        # after training_step): start from none, as Lightning's zero_grad would before backward.
        for param in module.parameters():
            param.grad = None
        with self.precision_plugin.train_step_context():
            loss = self._train_batch(batch, module)
        # Lightning zeroes gradients between training_step and backward: keep them aside until backward.
        self._stashed_grads = [(p, p.grad) for p in module.parameters() if p.grad is not None]
        for param, _ in self._stashed_grads:
            param.grad = None
        self._log_training(module, loss, batch)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            raise RuntimeError(self.manual_backward_refusal)
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
        self._before_evaluation()
        context = self.precision_plugin.val_step_context if stage == "val" else self.precision_plugin.test_step_context
        with context():
            loss = self._eval_batch(batch, module)
        # Every rank of a replica holds the same value; sync_dist averages over the replicas.
        size = self._batch_size(batch)
        module.log(f"{stage}/loss", loss, prog_bar=True, on_epoch=True, sync_dist=True, batch_size=size)
        return loss

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Metric reduction over the world through the counted collectives (label ``"metrics"``)."""
        if not isinstance(tensor, Tensor) or self.world_size == 1:
            return tensor
        name = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
        op = _REDUCE_OPS.get(name)
        if op is None:
            raise ValueError(f"{type(self).__name__}.reduce: unsupported reduce_op {reduce_op!r}.")
        result = tensor.detach().clone()
        if op == "avg" and not result.is_floating_point():
            result = result.float()
        comm.all_reduce(result, op, label=METRICS_LABEL, group=group)
        return result

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(self.predict_refusal)


class PipelineFabricStrategy(_StageViews, ReplacingFabricStrategyBase[SettingsT]):
    """Fabric base of the pipeline strategies: ``setup_module`` gives this rank's stage; ``fabric.backward`` is refused.

    The optimizers must be built after ``setup_module`` (the model's parameters are replaced by the stage's).
    """

    fp16_mixed_refusal: ClassVar[str] = "This strategy does not support precision='16-mixed'; use 'bf16-mixed'."
    """The error for ``precision='16-mixed'``."""
    backward_refusal: ClassVar[str] = "fabric.backward() is not used: strategy.train_step(batch) runs backward."
    """The error of ``fabric.backward``."""
    setup_replaces = "replaces the model by this rank's stage"

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if isinstance(self.precision, FabricMixedPrecision) and getattr(self.precision, "scaler", None) is not None:
            raise ValueError(self.fp16_mixed_refusal)
        self._claim_module(module)
        return self.runtime.setup(module, self.root_device, self.global_rank)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return self.runtime.sampler_kwargs(self.global_rank)

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(self.backward_refusal)
