"""Overlapping the inter-node exchange with backward: launch a unit's exchange as soon as its gradients are final.

FSDP2 (torch 2.13) reduce-scatters each unit (block) inside the model copy during backward and then calls the
``register_post_accumulate_grad_hook`` hooks of that unit's sharded parameters, right after assigning the sharded
``.grad``. Without sharding (shard size 1, one process) autograd calls the same hooks itself. :class:`OverlapHooks`
counts those calls per unit; when every parameter of a unit has its gradient, it calls
``optimizer.launch(unit.params)``, which computes the momentum/encoding and starts the asynchronous collective over the
replicate group, while backward continues on the earlier blocks. ``optimizer.step()`` launches the rest and waits.

Collectives are matched by order, so launches happen in one fixed unit order on every replica (last block first,
the root last): a unit that completes early waits for the units before it. Hooks only launch when armed: on the
final micro-batch of an accumulation window and when no gradient clipping has to see the gradients first.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_hetero.flexdemo.replicating import ReplicatingOptimizer
from lightning_hetero.flexdemo.sharding import ShardingUnit

__all__ = ["OverlapHooks"]


class OverlapHooks:
    """Per-unit readiness tracking that calls ``optimizer.launch`` in a fixed unit order during backward.

    Args:
        units: Units in launch order (backward order), restricted to parameters the optimizer updates.
        optimizer: The replicating optimizer whose ``launch`` starts the exchange.
    """

    def __init__(self, units: Sequence[ShardingUnit], optimizer: ReplicatingOptimizer) -> None:
        self.units = [unit for unit in units if unit.params]
        self.optimizer = optimizer
        self.armed = True
        """Whether the next gradient completions may launch (False on accumulation micro-batches)."""
        self.launched_units = 0
        """Units launched since the last :meth:`reset` (i.e. in this optimizer step)."""
        self._ready: list[set[int]] = [set() for _ in self.units]
        self._handles: list[RemovableHandle] = []
        for index, unit in enumerate(self.units):
            for param in unit.params:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(index)))
        # Every optimizer.step() ends the launch window, however it is called.
        self._handles.append(optimizer.register_step_post_hook(lambda *_: self.reset()))

    def _hook(self, index: int):  # noqa: ANN202
        def on_grad_ready(param: nn.Parameter) -> None:
            if not self.armed:
                return
            if index < self.launched_units:
                raise RuntimeError(
                    "FlexDeMo: a second backward produced gradients for a unit whose inter-node exchange was already "
                    "launched in this optimizer step. Run accumulation micro-batches without sync (the Trainer does "
                    "this for accumulate_grad_batches; with Fabric wrap them in fabric.no_backward_sync(model)), or "
                    "use FlexDeMoSettings(overlap=False)."
                )
            self._ready[index].add(id(param))
            self._launch_ready()

        return on_grad_ready

    def _launch_ready(self) -> None:
        while self.launched_units < len(self.units):
            unit = self.units[self.launched_units]
            if len(self._ready[self.launched_units]) < len(unit.params):
                return
            self.optimizer.launch(unit.params)
            self.launched_units += 1

    @property
    def launched_any(self) -> bool:
        """Whether any exchange started in the current optimizer step."""
        return self.launched_units > 0

    def reset(self) -> None:
        """Forget this step's readiness (runs after every ``optimizer.step()``)."""
        self.launched_units = 0
        for ready in self._ready:
            ready.clear()

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
