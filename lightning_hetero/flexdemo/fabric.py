"""``FlexDeMoStrategy`` for Fabric: FSDP2 inside a node, compressed momentum replication between nodes, your loop.

The work is done by :class:`~lightning_hetero.flexdemo.runtime.FlexDeMoRuntime`, shared with the Trainer strategy;
this module decides when it runs. Usage::

    fabric = Fabric(accelerator="cuda", devices=8, num_nodes=4, strategy=FlexDeMoStrategy(replicator="demo"))
    fabric.launch()
    model = fabric.setup_module(model)  # FSDP2 per block on the node, first replica's weights everywhere
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4))  # -> DecoupledAdamW
    for batch in loader:
        fabric.backward(model(**batch).loss)  # blocks' inter-node exchanges start during backward
        optimizer.step()                      # the rest is launched, everything is waited for and applied
        optimizer.zero_grad()

Accumulation micro-batches go inside ``with fabric.no_backward_sync(model):`` (no exchange is launched there; FSDP2
still reduce-scatters inside the node). ``fabric.clip_gradients`` clips with the node's gradient norm and needs
``overlap=False`` (the exchange would otherwise have started from the unclipped gradients). ``fabric.save`` writes a
directory with one file per rank; ``fabric.load`` restores it in place.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hetero.flexdemo.checkpoint import (
    META_FILE,
    full_state_dict,
    load_local_module_state,
    local_module_state,
    make_meta,
    rank_file,
    read_meta,
)
from lightning_hetero.flexdemo.conversion import repoint_scheduler
from lightning_hetero.flexdemo.precision import check_precision, compute_dtype_for
from lightning_hetero.flexdemo.runtime import FlexDeMoRuntime
from lightning_hetero.strategies.common import RuntimeFabricDDPStrategy, destroy_process_group_at_exit

__all__ = ["FlexDeMoStrategy"]


class _SyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: backward passes inside launch no inter-node exchange."""

    def __init__(self, strategy: FlexDeMoStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._strategy._blocked() if enabled else nullcontext()


class FlexDeMoStrategy(RuntimeFabricDDPStrategy):
    """Fabric strategy for FlexDeMo: FSDP2 per node, decoupled-momentum compressed replication across nodes.

    One model and one optimizer per Fabric. ``setup_optimizers`` converts ``AdamW``/``Adam`` to ``DecoupledAdamW``
    and ``SGD`` to ``DeMoSGD`` (same param groups; the returned optimizer is the converted one), and uses a
    ``ReplicatingOptimizer`` as given. After each ``optimizer.step()``, :attr:`last_comm_metrics` holds the step's
    ``comm/*`` metrics (e.g. ``fabric.log_dict(strategy.last_comm_metrics)``).

    Args:
        replicator: ``"demo"``, ``"random"``, ``"striding"``, ``"diloco"``, ``"full"`` or ``"topk"``.
        compression: Fraction of coefficients kept per step, in (0, 1].
        replicator_options: More ``build_replicator`` arguments (``values``, ``index_bits``, ``chunk``, ``seed``,
            ``combine``, ``sync_every``, ``outer_lr``, ``outer_momentum``).
        shard_size: Ranks that shard one model copy; None: all ranks of a node. Must divide the ranks per node.
        drift_check_every: Check replicas are bit-identical every N optimizer steps (0: off; DiLoCo: at the next
            synchronising step).
        overlap: Start each block's exchange during backward (set False to use ``fabric.clip_gradients``).
        activation_checkpointing: Recompute each block's activations in backward.
        block_classes: Class names of the blocks to shard individually (default: found from the model).
        accelerator: Set by Fabric.
        parallel_devices: Set by Fabric.
        cluster_environment: Set by Fabric.
        checkpoint_io: Set by Fabric.
        precision: Set by Fabric (``bf16-mixed`` gathers parameters in bf16, reduces in fp32).
        process_group_backend: ``torch.distributed`` backend (default: gloo on CPU, nccl on CUDA).
        timeout: Process group timeout.
        start_method: ``"popen"`` (scripts) or ``"spawn"`` (``fabric.launch(fn)`` in notebooks and tests).
    """

    strategy_name = "flexdemo"

    def __init__(
        self,
        replicator: str = "demo",
        compression: float = 1 / 32,
        replicator_options: dict[str, Any] | None = None,
        shard_size: int | None = None,
        drift_check_every: int = 0,
        overlap: bool = True,
        activation_checkpointing: bool = False,
        block_classes: list[str] | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.runtime = FlexDeMoRuntime(
            replicator,
            compression,
            replicator_options,
            shard_size,
            drift_check_every,
            overlap,
            activation_checkpointing,
            block_classes,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _SyncControl(self)
        self._sync_blocked = False
        self.last_comm_metrics: dict[str, float] = {}
        """The ``comm/*`` metrics of the last optimizer step."""

    @property
    def topology(self) -> Any:
        """The :class:`~lightning_hetero.flexdemo.topology.Topology` (after ``setup_module``)."""
        return self.runtime.topology

    def full_state_dict(self) -> dict[str, Tensor]:
        """The unsharded model state dict on every rank (collective inside each node), e.g. for an export."""
        if self.runtime.module is None:
            raise RuntimeError("FlexDeMoStrategy.full_state_dict() needs fabric.setup_module(model) first.")
        return full_state_dict(self.runtime.module, self.runtime.topology)

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def _configure_launcher(self) -> None:
        self.runtime.resolve_world(self.num_nodes * self.num_processes, self.num_processes)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit()

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        precision = getattr(self.precision, "precision", "32-true")
        check_precision(precision, self.runtime.owner)
        self.runtime.setup_module(module, self.root_device, compute_dtype_for(precision))
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return self.runtime.prepare_optimizer(optimizer)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        if len(optimizers) != 1:
            raise ValueError(f"{self.runtime.owner} takes exactly one optimizer, got {len(optimizers)}.")
        (optimizer,) = optimizers
        if any(optimizer.state.values()):
            raise ValueError(
                f"{self.runtime.owner}: the optimizer already holds state; set up the model and optimizer before the "
                "first step."
            )
        names = {id(param): name for name, param in module.named_parameters()}
        module = self.setup_module(module)  # fully_shard replaces the parameters with sharded ones
        sharded = dict(module.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] if id(p) in names else p for p in group["params"]]
        converted = self.setup_optimizer(optimizer)
        if scheduler is not None:
            repoint_scheduler(scheduler, optimizer, converted)
        return module, [converted], scheduler

    # ------------------------------------------------------------------------------------------------ training
    @contextmanager
    def _blocked(self) -> Any:
        previous, self._sync_blocked = self._sync_blocked, True
        self.runtime.arm(False)
        try:
            yield
        finally:
            self._sync_blocked = previous
            self.runtime.arm(not previous)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.runtime.before_step()
        output = super().optimizer_step(optimizer, **kwargs)
        self.last_comm_metrics = self.runtime.after_step()
        return output

    @override
    def teardown(self) -> None:
        self.runtime.teardown()
        super().teardown()

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return local_module_state(module)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        load_local_module_state(module, state_dict, strict, self.runtime.owner)

    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{self.runtime.owner}.save_checkpoint does not take storage_options.")
        converted = self._convert_stateful_objects_in_state(state, filter=(filter or {}))
        directory = Path(self.broadcast(str(path)))
        if directory.is_file() and self.is_global_zero:
            directory.unlink()  # a single-file checkpoint of another strategy under the same name
        self.barrier("flexdemo_checkpoint_prepare")
        directory.mkdir(parents=True, exist_ok=True)
        self.checkpoint_io.save_checkpoint(checkpoint=converted, path=rank_file(directory, self.global_rank))
        if self.is_global_zero and self.runtime.module is not None:
            torch.save(make_meta(self.runtime.module, self.runtime.topology), directory / META_FILE)
        self.barrier("flexdemo_checkpoint_saved")

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        read_meta(path, self.runtime.topology, self.runtime.owner)
        return super().load_checkpoint(rank_file(path, self.global_rank), state, strict, weights_only=False)
