"""The Lightning Trainer's position in training as plain numbers: the one module that reads and writes the Trainer's
private loop state.

A fault-tolerant node (``docs/spot.md``) hands its position to a joining one and follows a peer's after an in-place
heal; a stop below ``min_replicas`` saves a checkpoint without the batch in flight. Lightning has no public API for
any of this, so every private attribute used here is listed in :data:`LIGHTNING_PRIVATE_ATTRIBUTES`, and
``tests/unit/strategies/test_trainer_position.py`` resolves each on a live ``fit``: a Lightning upgrade that moves
one fails that test instead of a spot run.

- :class:`TrainerPosition`: ``global_step``, the loggers' step, epoch and batch, sent by a live peer
  (recovery state ``"trainer_position"``) and adopted by a joiner. A node healed *in place* (frozen or cut off past
  the timeout) drops the batch it drew for the step it missed (:meth:`TrainerPosition.drop_batch_in_flight`), so each
  step it commits trains that step's batch of its shard: none skipped, none off position.
- :func:`follow_peer_mid_epoch`: a node healed in place mid-epoch skips forward to the peer's (epoch, batch).
- :func:`batches_in_flight`: batches drawn whose step is not committed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.data.stateful import StatefulDataLoader

__all__ = [
    "LIGHTNING_PRIVATE_ATTRIBUTES",
    "POSITION_KEYS",
    "TrainerPosition",
    "batches_in_flight",
    "checked_position",
    "follow_peer_mid_epoch",
]

log = logging.getLogger(__name__)

POSITION_KEYS: tuple[str, ...] = ("global_step", "batches_that_stepped", "epoch", "batches")
"""The Trainer position a live peer hands a joining replica group (recovery state ``"trainer_position"``)."""

LIGHTNING_PRIVATE_ATTRIBUTES: tuple[str, ...] = (
    "fit_loop.epoch_loop._batches_that_stepped",
    "fit_loop.epoch_loop.batch_progress.current.completed",
    "fit_loop.epoch_loop.batch_progress.current.ready",
    "fit_loop.epoch_loop.batch_progress.is_last_batch",
    "fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total",
    "fit_loop.epoch_loop.manual_optimization.optim_step_progress.total",
    "fit_loop.epoch_loop.restarting",
    "fit_loop.epoch_progress",
    "fit_loop._data_fetcher.fetched",
    "fit_loop._data_fetcher.done",
    "fit_loop._data_fetcher.length",
    "fit_loop._data_fetcher.batches",
)
"""Every attribute path below ``trainer`` this module reads or writes that Lightning does not document as public
(the loops' progress trackers and the data fetcher). Resolved on a live ``fit`` by the test named above."""


class TrainerPosition:
    """The Trainer's place in training as plain numbers, sent by a live peer and adopted by a joining replica group.

    ``global_step`` (committed steps), ``batches_that_stepped`` (the loggers' step), ``epoch`` and ``batches`` (batches
    of that epoch done). A peer sends it from its quorum, where the batch in flight is not done yet. The joiner takes
    the steps always; the epoch and the batch only when healed before its first batch (the first quorum runs in
    ``on_train_start``) and its train loader is a :class:`StatefulDataLoader`: the loader then skips that many of its
    *own* batches (no sample of the peer's is copied) and the loop counts from there, as after a mid-epoch resume.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.iterating = False
        self._pending_stepped: int | None = None
        self._noted = False
        self._healed_in_place: dict[str, int] | None = None
        """The peer's position adopted mid-epoch, until the batch in flight is dropped."""
        self._schedules: tuple[list[dict[str, Any]], list[list[float]]] | None = None
        """LR scheduler states and optimizer learning rates to put back after a dropped batch (Lightning steps the
        schedulers once per batch, committed or not)."""

    def start(self) -> None:
        """``on_train_start``: no batch drawn yet; say once if the data position cannot follow a peer."""
        self.iterating = False
        if not isinstance(self.trainer.train_dataloader, StatefulDataLoader) and not self._noted:
            self._noted = True
            log.warning(
                "fault-tolerant mode: the train dataloader is a %s, not a single "
                "lightning_hetero.data.stateful.StatefulDataLoader, so its data position is per node and cannot "
                "follow the survivors when this node rejoins (global_step does). Use a StatefulDataLoader to continue "
                "at the survivors' epoch and batch on this node's own data.",
                type(self.trainer.train_dataloader).__name__,
            )

    def first_batch(self) -> None:
        """``on_train_batch_start``: finish an adoption made before the loop reset its counters, and undo the LR
        schedulers' step Lightning took after a dropped batch."""
        if not self.iterating:
            self.iterating = True
            if self._pending_stepped is not None:
                self.trainer.fit_loop.epoch_loop._batches_that_stepped = self._pending_stepped
                self._pending_stepped = None
        if self._schedules is not None:
            states, rates = self._schedules
            self._schedules = None
            for config, state in zip(self.trainer.lr_scheduler_configs, states, strict=True):
                config.scheduler.load_state_dict(state)
            for optimizer, optimizer_rates in zip(self.trainer.optimizers, rates, strict=True):
                for group, rate in zip(optimizer.param_groups, optimizer_rates, strict=True):
                    group["lr"] = rate

    def drop_batch_in_flight(self) -> None:
        """The batch in flight belongs to a step the quorum committed without this node (healed in place to a later
        one): it is not trained. Lightning still finishes it as a batch and an optimizer step, so the counters are set
        one short of the peer's (``global_step``, the loggers' step, the epoch's batches), the loader moves on to the
        peer's next batch of this node's own data, and the LR schedulers are put back at the next batch.

        Call between the heal and the end of the batch (the adapter's ``optimizer_step``), once per dropped batch.
        """
        trainer = self.trainer
        loop = trainer.fit_loop.epoch_loop
        self._step_counter().increment_by(-1)  # Lightning completes the dropped step: back to the peer's count
        loop._batches_that_stepped = max(int(loop._batches_that_stepped) - 1, 0)
        self._schedules = (
            [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            [[float(group["lr"]) for group in optimizer.param_groups] for optimizer in trainer.optimizers],
        )
        peer, self._healed_in_place = self._healed_in_place, None
        if peer is not None:
            follow_peer_mid_epoch(trainer, peer["epoch"], peer["batches"], peer["global_step"])

    def _step_counter(self) -> Any:
        """The optimizer-step progress whose completed total is ``global_step``."""
        trainer = self.trainer
        loop = trainer.fit_loop.epoch_loop
        module = trainer.lightning_module
        if module is None or module.automatic_optimization:
            return loop.automatic_optimization.optim_progress.optimizer.step.total
        return loop.manual_optimization.optim_step_progress.total

    def state_dict(self) -> dict[str, int]:
        loop = self.trainer.fit_loop.epoch_loop
        return {
            "global_step": int(self.trainer.global_step),
            "batches_that_stepped": int(loop._batches_that_stepped),
            "epoch": int(self.trainer.current_epoch),
            "batches": int(loop.batch_progress.current.completed),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt a peer's position (validated: counts >= 0).

        Raises:
            PeerPayloadError: A field is missing or not a count >= 0 (naming ``extra.trainer_position.<field>``).
        """
        position = checked_position(state)
        trainer = self.trainer
        loop = trainer.fit_loop.epoch_loop
        # global_step reads the total of completed optimizer steps; a step in flight (ready, not completed) stays so.
        self._step_counter().increment_by(position["global_step"] - trainer.global_step)
        loader = trainer.train_dataloader
        if self.iterating:
            loop._batches_that_stepped = position["batches_that_stepped"]
            # Healed in place (e.g. frozen past the timeout): the batch in flight was drawn for a step this node
            # missed; the adapter drops it (drop_batch_in_flight), which also moves the data position to the peer's.
            self._healed_in_place = position
            return
        self._pending_stepped = position["batches_that_stepped"]  # the loop's reset would change it
        if not isinstance(loader, StatefulDataLoader):
            return
        epochs = trainer.fit_loop.epoch_progress
        epochs.increment_by(position["epoch"] - trainer.current_epoch)
        loader.load_state_dict({"epoch": position["epoch"], "batches_yielded": position["batches"]})
        batches = loop.batch_progress
        batches.increment_by(position["batches"] - batches.current.completed)
        if position["batches"]:
            # Lightning's own mid-epoch resume: the epoch loop keeps these counters (and the fetcher's count) once.
            loop.restarting = True


def checked_position(state: Mapping[str, Any]) -> dict[str, int]:
    if not isinstance(state, Mapping):
        raise PeerPayloadError(
            f"recovery checkpoint: trainer_position is a {type(state).__name__}, not a dict; refusing it.",
            None,
            "extra.trainer_position",
        )
    position = {}
    for key in POSITION_KEYS:
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PeerPayloadError(
                f"recovery checkpoint: trainer_position.{key}={value!r} is not a count >= 0; refusing it.",
                None,
                f"extra.trainer_position.{key}",
            )
        position[key] = value
    return position


def follow_peer_mid_epoch(trainer: Any, epoch: int, batches: int, global_step: int) -> bool:
    """After an in-place heal mid-epoch: move this node's data position to the peer's ``(epoch, batches)``.

    ``batches`` is the peer's count of batches done in ``epoch``, so its next batch is number ``batches``. The batch in
    flight here (drawn before the heal, dropped) still completes as one batch of this epoch; the loader skips the
    batches this node missed, and the loop's counters (``batch_idx``, the epoch's end) move with it, so the next batch
    drawn is number ``batches``, as on the peer, and positions agree from then on. Only forward, within one epoch, and
    only with a :class:`StatefulDataLoader` the loop reads without prefetching; otherwise the position stays and a
    warning says so. Returns whether the position moved.
    """
    loop = trainer.fit_loop.epoch_loop
    own = (int(trainer.current_epoch), int(loop.batch_progress.current.completed) + 1)  # the batch in flight counts
    behind = batches - own[1]
    if own == (epoch, batches):
        return False
    loader = trainer.train_dataloader
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    prefetched = getattr(fetcher, "batches", None)
    movable = (
        isinstance(loader, StatefulDataLoader)
        and own[0] == epoch
        and behind > 0
        and fetcher is not None
        and getattr(fetcher, "length", None) is not None
        and not prefetched
    )
    if not movable:
        log.warning(
            "fault-tolerant mode: healed from a peer mid-epoch; global_step follows it (%d), the data position stays "
            "this node's (epoch %d, next batch %d; the peer's: epoch %d, next batch %d).",
            global_step,
            *own,
            epoch,
            batches,
        )
        return False
    loader.advance(behind)
    loop.batch_progress.increment_by(behind)  # ready, started, processed and completed alike
    fetcher.fetched += behind
    fetcher.done = fetcher.fetched >= fetcher.length
    loop.batch_progress.is_last_batch = fetcher.done
    log.warning(
        "fault-tolerant mode: healed from a peer mid-epoch at step %d; this node's data position moves %d batch(es) "
        "forward, to the peer's (epoch %d, next batch %d).",
        global_step,
        behind,
        epoch,
        batches,
    )
    return True


def batches_in_flight(trainer: Any) -> int:
    """Batches the fit loop drew whose step is not completed (committed) yet: 0 or 1 in a plain loop."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return max(int(progress.ready) - int(progress.completed), 0)
