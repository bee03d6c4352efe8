"""``FlexDeMoStrategy`` for Fabric: FSDP2 inside a node, compressed momentum replication between nodes, your loop.

The work is done by :class:`~lightning_hetero.flexdemo.runtime.FlexDeMoRuntime`, shared with the Trainer strategy;
this module decides when it runs. Usage::

    fabric = Fabric(accelerator="cuda", devices=8, num_nodes=4, strategy=FlexDeMoStrategy())
    fabric.launch()
    model = fabric.setup_module(model)  # FSDP2 per block on the node, first replica's weights everywhere
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4))  # -> DecoupledAdamW
    for batch in loader:
        fabric.backward(model(**batch).loss)  # blocks' inter-node exchanges start during backward
        optimizer.step()                      # the rest is launched, everything is waited for and applied
        optimizer.zero_grad()

Accumulation micro-batches go inside ``with fabric.no_backward_sync(model):`` (no exchange is launched there; FSDP2
still reduce-scatters inside the node). ``fabric.clip_gradients`` clips with the node's gradient norm and needs
``FlexDeMoSettings(overlap=False)`` (the exchange would otherwise have started from the unclipped gradients).
``fabric.save`` writes a directory with one file per rank; ``fabric.load`` restores it in place.

The fault-tolerant mode (``FlexDeMoSettings(fault_tolerance=...)``, ``docs/spot.md``; one launch per node): call
``strategy.start_step()`` at the top of every iteration, before the forward (it joins the step's torchft quorum; a
joining replica is healed there), and read ``strategy.last_commit`` after ``optimizer.step()`` (False: the quorum did
not commit the step, and the weights, gradients and optimizer state were restored). Your loop owns the counting:
``strategy.committed_steps`` is the quorum's committed step (equal on every replica group, a healed joiner included),
so index your data and stop by it, and retry a batch whose step was not committed::

    while strategy.committed_steps < total_steps:
        strategy.start_step()                        # a joiner is healed here: committed_steps jumps to the peers'
        batch = data[strategy.committed_steps]       # this node's own data at the committed position
        fabric.backward(model(**batch).loss)
        optimizer.step()                             # not committed: the next iteration retries the same batch
        optimizer.zero_grad()
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hetero.flexdemo.checkpoint import full_state_dict, load_local_module_state, local_module_state
from lightning_hetero.flexdemo.conversion import repoint_scheduler
from lightning_hetero.flexdemo.precision import check_precision, compute_dtype_for
from lightning_hetero.flexdemo.runtime import FlexDeMoRuntime
from lightning_hetero.flexdemo.settings import DEFAULT_SETTINGS, FlexDeMoSettings
from lightning_hetero.strategies.lifecycle import FabricStrategyBase

__all__ = ["FlexDeMoStrategy"]


class FlexDeMoStrategy(FabricStrategyBase[FlexDeMoSettings]):
    """Fabric strategy for FlexDeMo: FSDP2 per node, decoupled-momentum compressed replication across nodes.

    One model and one optimizer per Fabric. ``setup_optimizers`` converts ``AdamW``/``Adam`` to ``DecoupledAdamW``
    and ``SGD`` to ``DeMoSGD`` (same param groups; the returned optimizer is the converted one), and uses a
    ``ReplicatingOptimizer`` as given. After each ``optimizer.step()``, :attr:`last_comm_metrics` holds the step's
    ``comm/*`` metrics (e.g. ``fabric.log_dict(strategy.last_comm_metrics)``), and in the fault-tolerant mode
    ``ft/participants``, ``ft/committed`` and ``ft/step``.

    Usage: ``Fabric(strategy=FlexDeMoStrategy(settings=FlexDeMoSettings(shard_size=2)))``, or
    ``Fabric(strategy="flexdemo")`` for the default settings; the loop is in the module docstring.
    """

    settings_class = FlexDeMoSettings
    runtime_class = FlexDeMoRuntime

    def __init__(self, settings: FlexDeMoSettings = DEFAULT_SETTINGS, **kwargs: Any) -> None:
        """Takes a :class:`FlexDeMoSettings`; ``**kwargs`` are Lightning's arguments (see the base class)."""
        super().__init__(settings, **kwargs)
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
        module = self._setup_and_repoint(module, [optimizer])  # fully_shard replaces the parameters
        converted = self.setup_optimizer(optimizer)
        if scheduler is not None:
            repoint_scheduler(scheduler, optimizer, converted)
        return module, [converted], scheduler

    @property
    def committed_steps(self) -> int:
        """Fault-tolerant mode: steps the quorum committed (torchft's step; after ``start_step()`` a healed joiner
        has the survivors' count); 0 otherwise. Index your data and stop your loop by it."""
        return self.runtime.quorum.committed_steps

    @property
    def last_commit(self) -> bool | None:
        """Fault-tolerant mode: whether the last ``optimizer.step()`` was committed (None otherwise / before one)."""
        return self.runtime.quorum.last_commit

    # ------------------------------------------------------------------------------------------------ training
    def start_step(self) -> None:
        """Fault-tolerant mode: join this step's quorum before the forward (a joining replica is healed here).

        A no-op without ``settings.fault_tolerance``. Left out, ``optimizer.step()`` joins the quorum itself, after
        the backward: the step still commits correctly, but a joining replica's first gradient is computed on its
        stale weights.

        Raises:
            PeerPayloadError: The recovery checkpoint a live peer sent was refused.
        """
        self.runtime.quorum.start_step()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.runtime.before_step()
        parent = super()
        output = self.runtime.quorum.committed_step(lambda: parent.optimizer_step(optimizer, **kwargs))
        self.last_comm_metrics = {**self.runtime.after_step(), **self.runtime.quorum.metrics()}
        return output

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return local_module_state(module)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        load_local_module_state(module, state_dict, strict, self.runtime.owner)
