"""The Trainer side of the fault-tolerant (spot worker) mode, shared by the Trainer strategies that have it (FlexDeMo
and MatFormer, ``docs/spot.md``).

A strategy whose runtime owns a :class:`~lightning_hetero.ft.quorum_steps.QuorumSteps` calls one
:class:`TrainerQuorumGate` from its Lightning hooks:

- :meth:`~TrainerQuorumGate.attach` (``setup_optimizers``, once the quorum is joined): a joining node takes the
  survivors' LR schedulers and the Trainer's position (:class:`~lightning_hetero.strategies.trainer_position.
  TrainerPosition`) with the weights and the optimizer state.
- :meth:`~TrainerQuorumGate.train_start` / :meth:`~TrainerQuorumGate.batch_start`: each step's quorum before its
  forward (a joiner is healed there).
- :meth:`~TrainerQuorumGate.optimizer_step`: the step is kept only if the quorum commits it, else it runs again on
  the same batch in a new quorum; a batch whose step the quorum committed without this node (healed in place past it)
  is dropped, so ``global_step``, the LR schedulers and the data position count committed steps only.
- :meth:`~TrainerQuorumGate.on_exception`: below ``min_replicas`` for too long, a verified checkpoint before the stop.

:class:`QuorumGatedHooks` is the mixin that calls the hook-shaped ones from Lightning's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from typing_extensions import override

from lightning_hetero.ft.quorum_steps import QuorumSteps
from lightning_hetero.ft.waiting import ReplicasBelowMinimumError
from lightning_hetero.strategies.replica_data import save_below_minimum_checkpoint
from lightning_hetero.strategies.trainer_position import TrainerPosition

__all__ = ["QuorumGatedHooks", "TrainerQuorumGate"]


class TrainerQuorumGate:
    """The quorum-gated Lightning steps of one node (every call a no-op, the step just runs, outside the mode).

    Args:
        quorum: The strategy runtime's quorum steps (joined by the runtime; inactive outside the mode).
    """

    def __init__(self, quorum: QuorumSteps) -> None:
        self.quorum = quorum
        self.position: TrainerPosition | None = None
        """The Trainer position handed to and taken from peers (from :meth:`attach`)."""

    def attach(self, trainer: Any, lr_scheduler_configs: Iterable[Any]) -> None:
        """Hand a joining node the LR schedulers' state and the Trainer's position (after the quorum was joined)."""
        if not self.quorum.active:
            return
        configs = list(lr_scheduler_configs)
        # A joining node continues the survivors' schedule and step count, not fresh ones (its lr would differ).
        self.quorum.add_recovery_state(
            "lr_schedulers",
            lambda: [config.scheduler.state_dict() for config in configs],
            lambda states: [c.scheduler.load_state_dict(s) for c, s in zip(configs, states, strict=True)],
        )
        self.position = TrainerPosition(trainer)
        self.quorum.add_recovery_state("trainer_position", self.position.state_dict, self.position.load_state_dict)

    def train_start(self) -> None:
        """``on_train_start``: the first quorum before the first batch is drawn, so a joiner healed here can still
        move its data position."""
        if self.quorum.active and self.position is not None:
            self.position.start()
            self.quorum.start_step()

    def batch_start(self) -> None:
        """``on_train_batch_start``: this step's quorum (and any heal) before the forward."""
        if self.quorum.active and self.position is not None:
            self.position.first_batch()
        self.quorum.begin_batch()
        self.quorum.start_step()

    def optimizer_step(
        self,
        step: Callable[[Callable[[], Any]], Any],
        closure: Callable[[], Any],
        *,
        run_without_exchange: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> Any:
        """Run ``step(closure)`` (the strategy's optimizer step) gated on the quorum; returns its output.

        A discarded try runs again (the closure: forward and backward on the same batch) in a new quorum. A batch
        whose step the quorum committed without this node is dropped: Lightning needs the closure's result once, so
        when no try ran it yet the closure runs through ``run_without_exchange`` (default: as is; give it a wrapper
        when the strategy's backward would exchange), nothing is stepped, and the Trainer's counters move to the
        peer's (:meth:`TrainerPosition.drop_batch_in_flight`).
        """
        runs = [0]

        def counted_closure() -> Any:
            runs[0] += 1
            return closure()

        def drop_batch() -> None:
            if not runs[0]:
                (run_without_exchange or (lambda run: run()))(counted_closure)

        output = self.quorum.committed_step(lambda: step(counted_closure), retry=True, abandon=drop_batch)
        if self.quorum.last_abandoned and self.position is not None:
            self.position.drop_batch_in_flight()
        return output

    def on_exception(self, trainer: Any, exception: BaseException) -> None:
        """Too few nodes for too long: keep this node's committed state (a verified checkpoint, named in the error)."""
        if isinstance(exception, ReplicasBelowMinimumError) and trainer is not None:
            save_below_minimum_checkpoint(trainer, exception)


class QuorumGatedHooks:
    """The Lightning hooks of a Trainer strategy with the fault-tolerant mode, as a mixin placed before its Lightning
    base class: each step's quorum before the forward, and the checkpoint before a stop below ``min_replicas``. The
    strategy sets ``_gate`` in ``__init__`` and calls ``_gate.attach`` and ``_gate.optimizer_step`` itself."""

    _gate: TrainerQuorumGate
    lightning_module: Any

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self._gate.train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        self._gate.batch_start()

    @override
    def on_exception(self, exception: BaseException) -> None:
        module = self.lightning_module
        self._gate.on_exception(module._trainer if module is not None else None, exception)
        super().on_exception(exception)  # type: ignore[misc]
