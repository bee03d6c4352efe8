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

The fault-tolerant mode (``settings.fault_tolerance``, ``docs/spot.md``): each launch is one replica group (one node,
FSDP2 over its ranks; each rank a group rank of torchft's Manager). ``on_train_start`` joins the first quorum and
``on_train_batch_start`` every later one (a joining replica is healed there, before its forward); ``optimizer_step``
runs Lightning's step (closure included) and keeps it only if the quorum commits it, else runs it again on the same
batch in a new quorum, so ``global_step`` counts committed steps; then it logs ``ft/participants``, ``ft/committed``,
``ft/retries``, ``ft/step`` and ``ft/abandoned_batches``. LR schedulers' state and the Trainer's position
(``global_step``, the loggers' step, epoch and batch) travel with a recovery: a joiner continues at the survivors' step
and, with a :class:`~lightning_hetero.data.stateful.StatefulDataLoader`, at the same (epoch, batch) position of its own
data; a node healed in place mid-epoch drops the batch it drew for the step it missed (not trained) and reads the
committed step's batch next, so every step it commits trains that step's batch of its shard. With
``fault_tolerance.num_replica_groups`` the train loader reads this node's shard of the training set
(:mod:`~lightning_hetero.strategies.replica_data`). Too few replica groups for longer than
``wait_for_replicas_s``: ``on_exception`` saves a verified checkpoint before the error ends ``fit``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_hetero.core import process_rank_and_size
from lightning_hetero.flexdemo.checkpoint import full_state_dict, load_local_module_state, local_module_state
from lightning_hetero.flexdemo.conversion import repoint_scheduler
from lightning_hetero.flexdemo.optim import DecoupledAdamW
from lightning_hetero.flexdemo.precision import check_precision, compute_dtype_for
from lightning_hetero.flexdemo.runtime import FlexDeMoRuntime
from lightning_hetero.flexdemo.settings import DEFAULT_SETTINGS, FlexDeMoSettings
from lightning_hetero.hetero.batch_share import gradient_scale
from lightning_hetero.strategies.batch_share import TrainerBatchShare
from lightning_hetero.strategies.lifecycle import TrainerStrategyBase
from lightning_hetero.strategies.metric_names import log_step_metrics
from lightning_hetero.strategies.quorum_gate import QuorumGatedHooks, TrainerQuorumGate
from lightning_hetero.strategies.replica_data import shard_train_loader

__all__ = ["FlexDeMoStrategy"]

log = logging.getLogger(__name__)


def _redirected_step(method: str, context: str) -> Callable[..., Any]:
    """The strategy's ``method`` hook: the module's own step under the precision plugin's ``context``.

    The four step hooks differ only in these two names; :meth:`FlexDeMoStrategy._redirect` calls the step through the
    root FSDP module when sharded.
    """

    def step(self: FlexDeMoStrategy, *args: Any, **kwargs: Any) -> Any:
        with getattr(self.precision_plugin, context)():
            return self._redirect(method, *args, **kwargs)

    step.__name__ = step.__qualname__ = method
    return override(step)


class FlexDeMoStrategy(QuorumGatedHooks, TrainerStrategyBase[FlexDeMoSettings]):
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
        self._gate = TrainerQuorumGate(self.runtime.quorum)
        """The fault-tolerant mode's quorum-gated Lightning steps (no-ops outside it)."""
        self._batch_share = TrainerBatchShare(type(self).__name__)
        self._loss_scale = 1.0
        """``settings.batch_share``: ``world size x this rank's micro-batch / global batch`` (1.0 without)."""

    # ------------------------------------------------------------------------------------------------ public
    @property
    def micro_batch_sizes(self) -> list[int] | None:
        """Every rank's micro-batch under ``settings.batch_share`` (once the train loader is built), else None."""
        return self._batch_share.sizes

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
        original = self._only_optimizer("FlexDeMo replicates one update per step")
        module = self.lightning_module
        assert module is not None
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
        self._gate.attach(trainer, self.lr_scheduler_configs)

    def _clipping_configured(self, trainer: Any) -> bool:
        module = self.lightning_module
        clip = getattr(trainer, "gradient_clip_val", None)
        return bool(clip) or (module is not None and is_overridden("configure_gradient_clipping", module))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """``settings.batch_share``: the train loader's micro-batches by speed (``docs/batch_share.md``); every rank
        of one model copy gets one size. Other loaders, and runs without a share, are left as they are."""
        dataloader = super().process_dataloader(dataloader)
        ft = self.settings.fault_tolerance
        if ft is not None and self._batch_share.applies(self):
            # Every node is its own launch: its shard of the one training set comes from the replica group's index.
            rank, size = process_rank_and_size()
            dataloader = shard_train_loader(dataloader, ft, group_rank=rank, group_size=size, owner=self.runtime.owner)
        share = self.settings.batch_share
        if share is None or not self._batch_share.applies(self):
            return dataloader
        group = self.runtime.topology.shard_size
        loader = self._batch_share.train_loader(self, dataloader, share, group_size=group)
        assert self._batch_share.sizes is not None
        self._loss_scale = gradient_scale(self._batch_share.sizes, self.global_rank)
        if isinstance(self.runtime.optimizer, DecoupledAdamW):  # its normalized exchanges cancel the loss scale
            self.runtime.optimizer.contribution_weight = self._loss_scale
        return loader

    # ------------------------------------------------------------------------------------------------ training
    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Under a batch share, scale the loss so that the gradient entering the momentum is this rank's share of
        the token-weighted mean (the exchange's plain mean over ranks then gives that mean exactly)."""
        if self._loss_scale != 1.0:
            closure_loss = closure_loss * self._loss_scale
        return super().backward(closure_loss, optimizer, *args, **kwargs)

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

    training_step = _redirected_step("training_step", "train_step_context")
    validation_step = _redirected_step("validation_step", "val_step_context")
    test_step = _redirected_step("test_step", "test_step_context")
    predict_step = _redirected_step("predict_step", "predict_step_context")

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self.runtime.before_step()
        parent = super()
        # Fault-tolerant mode: kept only if the quorum commits it (FlexDeMo's exchange runs inside the step).
        output = self._gate.optimizer_step(lambda run: parent.optimizer_step(optimizer, run, model, **kwargs), closure)
        metrics = self.runtime.after_step()  # always: it re-arms the hooks and runs the drift guard
        if not self.settings.log_comm_stats:
            metrics = {}
        metrics.update(self.runtime.quorum.metrics())
        log_step_metrics(self.lightning_module, metrics)
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
