"""``FlexDeMoStrategy`` for the Lightning Trainer: FSDP2 inside a node, compressed momentum replication between nodes.

The ranks form a ``("replicate", "shard")`` mesh of shape ``(nodes, ranks per node)`` (or ``shard_size`` ranks per
model copy). Each copy is sharded with FSDP2 on its ``"shard"`` sub-mesh, so gradients are reduce-scattered inside
the node during backward and nothing is averaged across nodes by FSDP or DDP. The optimizer (a
:class:`~lightning_hetero.flexdemo.replicating.ReplicatingOptimizer`, converted from the user's AdamW/Adam/SGD)
exchanges a compressed update over the replicate group instead, started per block during backward (``overlap``).

How it plugs into the Trainer (narrow hooks of ``DDPStrategy``; there is no DDP wrapper):

- ``_configure_launcher``: ``settings.shard_size`` is checked against the ranks per node before any process starts.
- ``setup``: the copy is sharded (``configure_ddp``) before the optimizers exist; ``setup_optimizers`` converts the
  optimizer, re-points its LR schedulers, binds the replicate group and installs the overlap hooks.
- ``block_backward_sync`` (accumulation micro-batches): FSDP2 still reduce-scatters inside the node (gradients stay
  sharded and accumulate in place), but no inter-node exchange is launched; it starts on the final micro-batch.
- ``training_step`` & co. run through the root FSDP module's forward (forward redirection), so the root's
  parameters are gathered whatever the LightningModule's step calls.
- ``optimizer_step``: after the step, ``comm/*`` metrics are logged and the drift guard runs when due.
- Checkpoints are directories with one file per rank (:mod:`lightning_hetero.flexdemo.checkpoint`).

The fault-tolerant mode (``settings.fault_tolerance``, ``docs/spot.md``): each launch is one replica group of one
rank. ``on_train_batch_start`` joins the step's torchft quorum (a joining replica is healed there, before its
forward); ``optimizer_step`` runs Lightning's step (closure included) and keeps it only if the quorum commits it,
then logs ``ft/participants``, ``ft/committed`` and ``ft/step``. LR schedulers' state travels with a recovery.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_hetero.flexdemo.checkpoint import full_state_dict, load_local_module_state, local_module_state
from lightning_hetero.flexdemo.conversion import repoint_scheduler
from lightning_hetero.flexdemo.precision import check_precision, compute_dtype_for
from lightning_hetero.flexdemo.runtime import FlexDeMoRuntime
from lightning_hetero.flexdemo.settings import DEFAULT_SETTINGS, FlexDeMoSettings
from lightning_hetero.strategies.lifecycle import TrainerStrategyBase

__all__ = ["FlexDeMoStrategy"]


class FlexDeMoStrategy(TrainerStrategyBase[FlexDeMoSettings]):
    """FlexDeMo for the Trainer: FSDP2 per node, decoupled-momentum compressed replication across nodes.

    Works on any LightningModule (HF model built in ``__init__`` or ``configure_model``) with one optimizer:
    ``AdamW``/``Adam`` become ``DecoupledAdamW`` and ``SGD`` becomes ``DeMoSGD`` with the same param groups, and
    a ``DeMoSGD``/``DecoupledAdamW`` is used as given. Other optimizers raise before training.

    Usage: ``FlexDeMoStrategy(settings=FlexDeMoSettings(shard_size=2))``; in YAML,
    ``strategy: {class_path: FlexDeMoStrategy, init_args: {settings: {shard_size: 2}}}``.
    """

    settings_class = FlexDeMoSettings
    runtime_class = FlexDeMoRuntime

    def __init__(self, settings: FlexDeMoSettings = DEFAULT_SETTINGS, **kwargs: Any) -> None:
        """Takes a :class:`FlexDeMoSettings`; ``**kwargs`` are Lightning's arguments (see the base class)."""
        super().__init__(settings, **kwargs)

    # ------------------------------------------------------------------------------------------------ public

    @property
    def topology(self) -> Any:
        """The :class:`~lightning_hetero.flexdemo.topology.Topology` (from ``setup`` on)."""
        return self.runtime.topology

    @property
    def device_mesh(self) -> Any:
        """The ``("replicate", "shard")`` DeviceMesh (None in a single process)."""
        return self.runtime.topology.mesh

    def full_state_dict(self) -> dict[str, Tensor]:
        """The unsharded model state dict on every rank (collective inside each node), e.g. for an export."""
        assert self.lightning_module is not None
        return full_state_dict(self.lightning_module, self.runtime.topology)

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _FullWeightsLauncher(self, start_method=self._start_method)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        check_precision(self.precision_plugin.precision, self.runtime.owner)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.configure_ddp()  # shards in every stage: validate/test without fit also run sharded
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def configure_ddp(self) -> None:
        """Shard the model copy instead of wrapping it in DDP (before the optimizers exist)."""
        module = self.lightning_module
        assert module is not None
        if self.runtime.module is None:
            dtype = compute_dtype_for(self.precision_plugin.precision)
            self.runtime.setup_module(module, self.root_device, dtype)
        elif self.runtime.module is not module:
            raise RuntimeError(
                f"{self.runtime.owner} already sharded another LightningModule; use one strategy instance per model."
            )

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{self.runtime.owner} needs exactly one optimizer from configure_optimizers, got "
                f"{len(self.optimizers)}: FlexDeMo replicates one update per step."
            )
        module = self.lightning_module
        assert module is not None
        original = self.optimizers[0]
        wanted = self.settings.overlap
        overlap = wanted and not self._clipping_configured(trainer) and module.automatic_optimization
        if wanted and not overlap:
            rank_zero_info(
                f"{self.runtime.owner}: overlap turned off (gradient clipping or manual optimization needs the whole "
                "gradient before the exchange starts)."
            )
        converted = self.runtime.prepare_optimizer(original, overlap=overlap)
        rank_zero_info(f"{self.runtime.owner}: {self.runtime.conversion}.")
        if self.runtime.replicator_note:
            rank_zero_info(f"{self.runtime.owner}: {self.runtime.replicator_note}.")
        for config in self.lr_scheduler_configs:
            repoint_scheduler(config.scheduler, original, converted)
        self.optimizers = [converted]
        self._use_runtime_clipping()
        if self.runtime.replica is not None:
            configs = list(self.lr_scheduler_configs)
            # A joining replica must continue the survivors' schedule, not restart it (its lr would differ).
            self.runtime.add_recovery_state(
                "lr_schedulers",
                lambda: [config.scheduler.state_dict() for config in configs],
                lambda states: [c.scheduler.load_state_dict(s) for c, s in zip(configs, states, strict=True)],
            )

    def _clipping_configured(self, trainer: Any) -> bool:
        module = self.lightning_module
        clip = getattr(trainer, "gradient_clip_val", None)
        return bool(clip) or (module is not None and is_overridden("configure_gradient_clipping", module))

    # ------------------------------------------------------------------------------------------------ training
    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        pass  # no DDP reducer to prepare

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        pass  # FSDP2 reduced inside the node; the optimizer exchanges across nodes

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        if self.runtime.sharded:
            # The LightningModule is the root FSDP module: call it so that its pre-forward gathers the root's
            # parameters (embeddings, heads) around the step, whatever the step calls.
            return self._forward_redirection(module, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.runtime.start_replica_step()  # fault-tolerant mode: the quorum (and any healing) before the forward

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self.runtime.before_step()
        parent = super()
        output = self.runtime.committed_step(lambda: parent.optimizer_step(optimizer, closure, model, **kwargs))
        metrics = self.runtime.after_step()  # always: it re-arms the hooks and runs the drift guard
        if not self.settings.log_comm_stats:
            metrics = {}
        metrics.update(self.runtime.replica_metrics())
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            for name, value in metrics.items():
                module.log(name, value, on_step=True, on_epoch=False, batch_size=1, rank_zero_only=True)
        return output

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return local_module_state(self.lightning_module)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        load_local_module_state(self.lightning_module, checkpoint["state_dict"], strict, self.runtime.owner)


class _FullWeightsLauncher(_MultiProcessingLauncher):
    """Spawn launcher whose rank 0 hands the *unsharded* weights back to the main process after ``fit``."""

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        strategy = trainer.strategy
        if trainer.state.fn != TrainerFn.FITTING or not strategy.runtime.sharded:
            return super()._collect_rank_zero_results(trainer, results)
        full = strategy.full_state_dict()  # collective inside each copy: every rank joins
        trainer.lightning_module.state_dict = lambda *a, **k: full  # what the base class saves for the main process
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del trainer.lightning_module.state_dict  # the instance attribute; the method is back
