"""A DataLoader whose position in the epoch survives a checkpoint, so a resumed run continues with the next batch.

With a plain ``DataLoader``, Lightning restarts an interrupted epoch from its first batch: the batches before the
checkpoint are seen twice and the resumed run drifts from an uninterrupted one. :class:`StatefulDataLoader` implements
``state_dict``/``load_state_dict`` (Lightning's ``_Stateful`` protocol), so:

- the Trainer saves its position in ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]`` and restores
  it before the resumed epoch starts;
- Fabric saves it when the loader is part of the state: ``fabric.save(path, {"model": ..., "train_loader": loader})``
  and ``fabric.load(path, state)`` restore it (Fabric unwraps its loader wrapper itself).

The position is an ``(epoch, batches_yielded)`` pair. A resumed epoch draws the same order as the original (seeded
shuffling: :class:`EpochSeededRandomSampler` here, ``DistributedSampler`` where Lightning or Fabric injects one, both
a function of ``seed + epoch``) and skips the batches already consumed at the *index* level: no sample of a skipped
batch is loaded or collated. Workers (``num_workers > 0``, persistent or not) work the same way, because batches are
counted when they reach the caller, not when a worker prefetches them.

Epochs only move forward after a restore: Fabric's loader wrapper numbers epochs from 0 in every new process, so the
loader never lets a sampler's epoch drop below the one it restored (or below the epoch after the last completed one).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Sized
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

STATE_VERSION = 1
"""Version of :meth:`StatefulDataLoader.state_dict`'s layout."""


class EpochSeededRandomSampler(RandomSampler):
    """Shuffles with ``torch.randperm`` seeded by ``seed + epoch`` (PyTorch's ``DistributedSampler`` convention).

    Unlike a ``RandomSampler`` with a shared generator, the order of epoch ``e`` does not depend on how many epochs
    ran in this process, so a run resumed in epoch ``e`` draws exactly the original order. It subclasses
    ``RandomSampler`` so that Lightning still recognizes the loader as shuffled (and swaps in a ``DistributedSampler``
    in distributed runs).

    Args:
        data_source: The dataset (only its length is used).
        seed: Base seed (epoch ``e`` draws ``torch.randperm(n, generator=manual_seed(seed + e))``).
    """

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` (Lightning calls this at each epoch start)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class _SkippingIndexSampler:
    """Wraps the loader's batch sampler (or sampler): an iteration drops its first ``skip`` index lists.

    The loader sets ``skip`` only while it creates its base iterator (which may call ``iter`` here more than once:
    a multi-worker iterator does in its constructor and again in its first reset), then sets it back to 0.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.skip = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.inner), self.skip, None)


class StatefulDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` plus a restorable position (see the module docstring).

    Args:
        dataset: Map-style dataset (iterable datasets have no index to skip to and are refused).
        batch_size: Samples per batch.
        shuffle: Shuffle with an :class:`EpochSeededRandomSampler` seeded by ``seed`` (ignored when ``sampler`` is
            given, as when Lightning re-creates the loader with a ``DistributedSampler``).
        sampler: An explicit sampler; give it ``set_epoch``/``epoch`` for shuffling that survives a resume.
        seed: Base seed of the shuffle.
        **kwargs: Any other ``DataLoader`` argument (``drop_last``, ``num_workers``, ``collate_fn``, ...).

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset``.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        *,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError(
                "`dataset` of a StatefulDataLoader must be map-style (indexable): an IterableDataset has no position "
                "to skip to. Use a plain DataLoader, or a map-style dataset."
            )
        if sampler is None and shuffle and kwargs.get("batch_sampler") is None:
            sampler, shuffle = EpochSeededRandomSampler(dataset, seed), None
        super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, **kwargs)
        self.seed = seed  # public so that Lightning can re-create the loader from its attributes
        self._epoch = 0  # epoch of the iteration in progress (or the last one started)
        self._yielded = 0  # batches handed out in that epoch
        self._epoch_floor = 0  # lowest epoch the next iteration may use
        self._pending: dict[str, int] | None = None  # a restored position not yet applied
        self._jump = 0  # batches advance() asked to skip in the epoch in progress
        self._held_back = 0  # handed-out batches state_dict() counts as not consumed (holding_back)

    # ------------------------------------------------------------------------------------------------ iteration

    @property
    def _index_sampler(self) -> Any:
        # One wrapper for the loader's life: persistent workers keep the index sampler of their first iterator.
        skipper = self.__dict__.get("_skipper")
        if skipper is None:
            inner = self.batch_sampler if self._auto_collation else self.sampler
            skipper = self.__dict__["_skipper"] = _SkippingIndexSampler(inner)
        return skipper

    def _epoch_owner(self) -> Any:
        """The sampler whose ``set_epoch`` decides the order (None: the order does not depend on the epoch)."""
        for candidate in (self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if callable(getattr(candidate, "set_epoch", None)):
                return candidate
        return None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # A generator: its body runs at the first ``next``, after Lightning's ``set_epoch`` for this epoch.
        owner = self._epoch_owner()
        epoch = max(int(getattr(owner, "epoch", self._epoch_floor)), self._epoch_floor)
        if owner is not None and getattr(owner, "epoch", None) != epoch:
            owner.set_epoch(epoch)
        pending, self._pending = self._pending, None
        skip = pending["batches_yielded"] if pending is not None and pending["epoch"] == epoch else 0
        self._epoch, self._yielded, self._epoch_floor = epoch, skip, epoch
        self._jump = 0
        batches = self._base_iterator(skip)
        while True:
            if self._jump:  # advance() during this epoch: restart the base iterator further on, same order
                self._yielded, self._jump = self._yielded + self._jump, 0
                batches = self._base_iterator(self._yielded)
            try:
                batch = next(batches)
            except StopIteration:
                break
            self._yielded += 1
            yield batch
        self._epoch_floor = epoch + 1  # the epoch is complete: the next one starts fresh

    def _base_iterator(self, skip: int) -> Iterator[Any]:
        """DataLoader's iterator of this epoch's order, its first ``skip`` batches dropped at the index level."""
        skipper = self._index_sampler
        skipper.skip = skip
        try:
            return super().__iter__()
        finally:
            skipper.skip = 0

    @property
    def batches_yielded(self) -> int:
        """Batches of the epoch in progress handed out so far (plus any :meth:`advance` not applied yet)."""
        return self._yielded + self._jump

    def advance(self, batches: int) -> None:
        """Skip the next ``batches`` batches of the epoch in progress (index level: none is loaded or collated).

        For a position that must jump forward mid-epoch (a fault-tolerant node healed from a peer that is further on):
        the next batch drawn is the one ``batches`` further on in this epoch's order; past the epoch's end the epoch
        ends. Applied at the next ``next()``.

        Raises:
            ValueError: ``batches`` < 0 (positions only move forward).
        """
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(f"`batches` must be an int >= 0 (positions only move forward), got {batches!r}.")
        self._jump += batches

    # ------------------------------------------------------------------------------------------------ state

    def _replicas(self) -> int:
        return int(getattr(self.sampler, "num_replicas", 1))

    def _unit(self) -> tuple[int, int]:
        """``(batch size, replicas)`` that a position counts in; a batch sampler with a ``global_batch`` (a batch
        share's :class:`~lightning_hetero.hetero.batch_share.ShareBatchSampler`) counts whole global batches."""
        global_batch = getattr(self.batch_sampler, "global_batch", None)
        if self.batch_size is None and isinstance(global_batch, int):
            return global_batch, 1
        return int(self.batch_size or 1), self._replicas()

    def state_dict(self) -> dict[str, int]:
        """Position of the loader: the epoch in progress and how many of its batches were handed out.

        A finished epoch is saved as the start of the next one, so resuming from an end-of-epoch checkpoint does
        not skip anything.
        """
        if self._pending is not None:  # restored but not iterated yet: the restored position still holds
            epoch, yielded = self._pending["epoch"], self._pending["batches_yielded"]
        elif self._held_back:
            epoch, yielded = self._epoch, max(min(self._yielded + self._jump, len(self)) - self._held_back, 0)
        elif self._epoch_floor > self._epoch or self._yielded >= len(self):
            epoch, yielded = max(self._epoch_floor, self._epoch + 1), 0
        else:
            epoch, yielded = self._epoch, min(self._yielded + self._jump, len(self))
        batch, replicas = self._unit()
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "batches_yielded": yielded,
            "batch_size": batch,
            "num_replicas": replicas,
        }

    @contextmanager
    def holding_back(self, batches: int) -> Iterator[None]:
        """Inside the block, :meth:`state_dict` counts the last ``batches`` handed-out batches as not consumed.

        For a checkpoint taken while a batch is in flight (drawn, its step not done): a run resumed from it draws that
        batch again instead of skipping it.
        """
        self._held_back = batches
        try:
            yield
        finally:
            self._held_back = 0

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continue from ``state_dict`` at the next iteration (same epoch order, its consumed batches skipped).

        A position saved with another batch size or number of replicas is converted through the number of samples
        all replicas consumed (exact when it divides; otherwise rounded down, with a warning: a few samples repeat).

        Raises:
            ValueError: ``state_dict`` is not a StatefulDataLoader state.
        """
        missing = {"epoch", "batches_yielded"} - set(state_dict)
        if missing:
            raise ValueError(
                f"`state_dict` is not a StatefulDataLoader state (missing {sorted(missing)}); pass what "
                "`StatefulDataLoader.state_dict()` returned."
            )
        epoch, yielded = int(state_dict["epoch"]), int(state_dict["batches_yielded"])
        batch, replicas = self._unit()
        saved_batch = int(state_dict.get("batch_size", batch))
        saved_replicas = int(state_dict.get("num_replicas", replicas))
        if (saved_batch, saved_replicas) != (batch, replicas):
            samples = yielded * saved_batch * saved_replicas
            yielded, remainder = divmod(samples, batch * replicas)
            if remainder:
                warnings.warn(
                    f"The loader position was saved with batch_size={saved_batch} x {saved_replicas} replicas and is "
                    f"restored with {batch} x {replicas}: {samples} samples consumed is not a whole number of new "
                    f"batches, so the last {remainder} are seen again.",
                    stacklevel=2,
                )
        self._pending = {"epoch": epoch, "batches_yielded": yielded}
        self._epoch_floor = epoch
        owner = self._epoch_owner()
        if owner is not None:
            owner.set_epoch(epoch)
