"""Bounded replay buffer of received activations for asynchronous decoupled greedy training (DGL).

In asynchronous mode a stage does not wait for the activations of its own step: it trains on the most recent
activations the previous stage has sent so far (Belilovsky et al. 2020, "DGL with a replay buffer"). Two bounded
structures hold what that needs:

- :class:`ReplayBuffer`: the last ``capacity`` received activation tensors, each tagged with the step at which the
  previous stage produced it. Older entries are dropped when a new one arrives (their batch is then never trained on
  by this stage).
- :class:`BatchRing`: this stage's own last ``capacity`` batches, keyed by step, so the labels (and attention masks)
  of a replayed activation are read locally and never cross the link.

Staleness of an entry used at step ``t`` is ``t - entry.step``; :meth:`ReplayBuffer.newest_usable` only returns
entries with ``0 <= t - entry.step < capacity``, so staleness is bounded by ``capacity - 1`` steps. Nothing here
imports Lightning or touches the network.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["BatchRing", "ReplayBuffer", "ReplayEntry", "check_capacity"]


def check_capacity(capacity: object, owner: str = "ReplayBuffer", name: str = "capacity") -> int:
    """``capacity`` as an int >= 1, or a ValueError naming the argument."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"{owner}({name}={capacity!r}): use an int >= 1 (the number of buffered steps).")
    return capacity


@dataclass
class ReplayEntry:
    """One received activation tensor and the step at which the previous stage produced it."""

    step: int
    activations: Tensor
    uses: int = field(default=0)
    """How many training steps of this stage have used it so far (> 1: replayed)."""


class ReplayBuffer:
    """The last ``capacity`` activation tensors received from the previous stage, oldest first.

    Args:
        capacity: Entries kept; pushing into a full buffer drops the oldest.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = check_capacity(capacity)
        self._entries: deque[ReplayEntry] = deque()
        self.pushed = 0
        """Entries pushed so far."""
        self.dropped_unused = 0
        """Entries dropped before any step trained on them."""
        self.replays = 0
        """Training steps that reused an entry an earlier step had already used."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def steps(self) -> list[int]:
        """Steps of the buffered entries, oldest first."""
        return [entry.step for entry in self._entries]

    @property
    def last_step(self) -> int | None:
        """Step of the newest entry (None when empty)."""
        return self._entries[-1].step if self._entries else None

    def push(self, step: int, activations: Tensor) -> None:
        """Add the activations of the batch read at ``step``; drops the oldest entry when full.

        Steps never decrease. An equal step replaces the newest entry: a predecessor that replayed a batch sent newer
        activations of that same batch (computed with its later weights).
        """
        last = self._entries[-1].step if self._entries else None
        if last is not None and step < last:
            raise ValueError(f"ReplayBuffer.push(step={step}): steps must not decrease (last was {last}).")
        if last is not None and step == last:
            self._entries[-1] = ReplayEntry(step, activations)
            self.pushed += 1
            return
        self._entries.append(ReplayEntry(step, activations))
        self.pushed += 1
        while len(self._entries) > self.capacity:
            dropped = self._entries.popleft()
            self.dropped_unused += dropped.uses == 0

    def newest_usable(self, step: int) -> ReplayEntry | None:
        """The newest entry produced at or before ``step`` and less than ``capacity`` steps before it, or None.

        The returned entry is marked used (``uses`` + 1; a second use counts in :attr:`replays`).
        """
        for entry in reversed(self._entries):
            if entry.step <= step:
                if step - entry.step >= self.capacity:
                    return None
                entry.uses += 1
                self.replays += entry.uses > 1
                return entry
        return None

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        self._entries.clear()

    def stats(self) -> dict[str, int]:
        """Counters for logging: size, pushed, dropped_unused, replays."""
        return {
            "size": len(self),
            "pushed": self.pushed,
            "dropped_unused": self.dropped_unused,
            "replays": self.replays,
        }


class BatchRing:
    """This stage's last ``capacity`` batches, keyed by step (the labels of replayed activations are read here).

    Args:
        capacity: Batches kept; adding to a full ring drops the oldest.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = check_capacity(capacity, "BatchRing")
        self._batches: OrderedDict[int, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._batches)

    def add(self, step: int, batch: Any) -> None:
        """Keep ``batch`` as the batch of ``step``."""
        self._batches[step] = batch
        self._batches.move_to_end(step)
        while len(self._batches) > self.capacity:
            self._batches.popitem(last=False)

    def get(self, step: int) -> Any:
        """The batch of ``step``; KeyError (naming the kept steps) when it is no longer kept."""
        try:
            return self._batches[step]
        except KeyError:
            raise KeyError(f"BatchRing: step {step} is not kept (kept: {list(self._batches)}).") from None

    def clear(self) -> None:
        """Drop every batch."""
        self._batches.clear()
