"""The byte ledger: the one place where bytes that cross a process boundary are counted.

Every wrapper in :mod:`lightning_hetero.comm.collectives` records one :class:`CommRecord` per call into a
:class:`ByteLedger` (the process-global one from :func:`get_ledger` unless a private ``ledger=`` is passed). The
ledger never talks to the network and imports no framework: it is plain bookkeeping, cheap enough to call on every
collective, and bounded in memory for arbitrarily long runs:

- cumulative totals per label, forever (a handful of labels);
- per-step totals per label for the last ``max_steps_kept`` steps (the oldest step seen is dropped first);
- the last ``max_records`` individual calls in a ring buffer.

:func:`wire_bytes` is the counting rule itself, a pure function (documented in
:mod:`lightning_hetero.comm.collectives` and ``docs/communication.md``).

Steps: every record carries the ledger's current :attr:`ByteLedger.step`. A new ledger starts at :data:`SETUP_STEP`
(``-1``), so traffic before the first step boundary (a strategy's initial model broadcast, checkpoint restore, the
sanity check) lands in its own bucket instead of inflating step 0; :class:`CommunicationMonitor` re-marks the setup
phase at the start of every fit and logs it once as ``comm/<label>/bytes_sent_setup``.

Labels say which link a call used. :data:`INTRA` (inside a node), :data:`INTER` (between nodes) and
:data:`PIPELINE` (stage boundaries) are the standard ones; any non-empty string is allowed.

Counts are this process's own view: ``sent`` is what this rank put on the wire and ``received`` what it took off,
following the idealized rule documented in :mod:`lightning_hetero.comm.collectives` and ``docs/communication.md``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COUNTED_OPS",
    "INTER",
    "INTRA",
    "PIPELINE",
    "SETUP_STEP",
    "STANDARD_LABELS",
    "ByteLedger",
    "CommRecord",
    "LedgerTotals",
    "get_ledger",
    "validate_label",
    "wire_bytes",
]

INTRA = "intra"
"""Traffic between ranks of the same node (e.g. the FSDP shard group)."""
INTER = "inter"
"""Traffic between nodes over the slow link (e.g. the FlexDeMo replicate group)."""
PIPELINE = "pipeline"
"""Activations and gradients crossing a pipeline stage boundary."""
STANDARD_LABELS: tuple[str, ...] = (INTRA, INTER, PIPELINE)

SETUP_STEP = -1
"""The step of traffic before the first step boundary: a new ledger starts here (see the module docstring)."""

_STATE_VERSION = 1

#: Collective names :func:`wire_bytes` knows (the ``op`` of a :class:`CommRecord` written by the wrappers).
COUNTED_OPS: frozenset[str] = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "broadcast",
        "send",
        "isend",
        "recv",
        "irecv",
        "all_to_all_single",
    }
)


@dataclass(frozen=True)
class LedgerTotals:
    """Byte and call counts of one label (or of all labels)."""

    sent: int = 0
    """Bytes this rank put on the wire."""
    received: int = 0
    """Bytes this rank took off the wire."""
    calls: int = 0
    """Number of recorded collective calls."""

    def __add__(self, other: LedgerTotals) -> LedgerTotals:
        return LedgerTotals(self.sent + other.sent, self.received + other.received, self.calls + other.calls)

    def __sub__(self, other: LedgerTotals) -> LedgerTotals:
        return LedgerTotals(self.sent - other.sent, self.received - other.received, self.calls - other.calls)

    def to_dict(self) -> dict[str, int]:
        """Plain-dict form, used in state dicts."""
        return {"sent": self.sent, "received": self.received, "calls": self.calls}


@dataclass(frozen=True)
class CommRecord:
    """One recorded collective call, as seen by this rank."""

    op: str
    """Collective name, e.g. ``"all_reduce"`` or ``"isend"``."""
    label: str
    """Link label, e.g. :data:`INTER`."""
    group_size: int
    """Number of ranks in the process group the call ran on."""
    payload_bytes: int
    """The ``S`` of the counting rule for this op (see ``docs/communication.md``)."""
    sent: int
    """Bytes this rank sent."""
    received: int
    """Bytes this rank received."""
    step: int
    """Value of :attr:`ByteLedger.step` when the call was recorded."""


def validate_label(label: object) -> str:
    """Return ``label`` if it is a non-empty string, else raise a ValueError naming the standard labels."""
    if not isinstance(label, str) or not label:
        raise ValueError(
            f"label must be a non-empty string such as {INTRA!r}, {INTER!r} or {PIPELINE!r}; got {label!r}."
        )
    return label


class ByteLedger:
    """Counts bytes sent and received per label, per step and per call, with bounded memory.

    Args:
        max_records: How many individual :class:`CommRecord` to keep (a ring buffer; older ones are dropped).
        max_steps_kept: How many steps of per-step totals to keep; the step first seen longest ago is dropped.

    Example:
        >>> ledger = ByteLedger()
        >>> ledger.set_step(3)
        >>> _ = ledger.record("all_reduce", INTER, payload_bytes=100, sent=100, received=100, group_size=2)
        >>> ledger.totals(INTER)
        LedgerTotals(sent=100, received=100, calls=1)
        >>> ledger.step_totals(3)[INTER].sent
        100
    """

    def __init__(self, max_records: int = 10_000, max_steps_kept: int = 10_000) -> None:
        if max_records < 0:
            raise ValueError(f"max_records must be >= 0, got {max_records}.")
        if max_steps_kept < 1:
            raise ValueError(f"max_steps_kept must be >= 1, got {max_steps_kept}.")
        self.max_records = max_records
        self.max_steps_kept = max_steps_kept
        self._lock = threading.RLock()  # async work and callbacks may record from other threads
        self._step = SETUP_STEP  # nothing has marked a training step yet
        self._totals: dict[str, LedgerTotals] = {}
        self._step_totals: OrderedDict[int, dict[str, LedgerTotals]] = OrderedDict()
        self._records: deque[CommRecord] = deque(maxlen=max_records)
        self._captures: list[ByteLedger] = []

    # ----------------------------------------------------------------------------------------------- step
    @property
    def step(self) -> int:
        """The step stamped on new records: :data:`SETUP_STEP` until set (the callback sets ``trainer.global_step``)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self.set_step(value)

    def set_step(self, step: int) -> None:
        """Stamp future records with ``step`` (also forwarded to open :meth:`capture` views)."""
        with self._lock:
            self._step = int(step)
            for view in self._captures:
                view.set_step(step)

    # --------------------------------------------------------------------------------------------- record
    def record(self, op: str, label: str, payload_bytes: int, sent: int, received: int, group_size: int) -> CommRecord:
        """Record one collective call made by this rank.

        Args:
            op: Collective name.
            label: Non-empty link label, e.g. :data:`INTER`.
            payload_bytes: The ``S`` of the counting rule.
            sent: Bytes this rank sent.
            received: Bytes this rank received.
            group_size: Ranks in the process group.

        Returns:
            The stored record.

        Raises:
            ValueError: Empty label, negative byte counts or a group size below 1.
        """
        validate_label(label)
        if min(payload_bytes, sent, received) < 0:
            raise ValueError(
                f"Byte counts must be >= 0; got payload_bytes={payload_bytes}, sent={sent}, received={received}."
            )
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}.")
        with self._lock:
            entry = CommRecord(op, label, int(group_size), int(payload_bytes), int(sent), int(received), self._step)
            self._add(entry)
            return entry

    def _add(self, entry: CommRecord) -> None:
        with self._lock:
            delta = LedgerTotals(entry.sent, entry.received, 1)
            self._totals[entry.label] = self._totals.get(entry.label, LedgerTotals()) + delta
            per_label = self._step_totals.get(entry.step)
            if per_label is None:
                per_label = self._step_totals[entry.step] = {}
                while len(self._step_totals) > self.max_steps_kept:
                    self._step_totals.popitem(last=False)
            per_label[entry.label] = per_label.get(entry.label, LedgerTotals()) + delta
            if self.max_records:
                self._records.append(entry)
            for view in self._captures:
                view._add(entry)

    # -------------------------------------------------------------------------------------------- queries
    def totals(self, label: str | None = None) -> LedgerTotals:
        """Cumulative totals of ``label``, or summed over every label when ``label`` is None."""
        with self._lock:
            if label is not None:
                return self._totals.get(label, LedgerTotals())
            return sum(self._totals.values(), LedgerTotals())

    def step_totals(self, step: int | None = None) -> dict[str, LedgerTotals]:
        """Totals per label recorded while :attr:`step` was ``step`` (default: the current step).

        Returns an empty dict for a step with no traffic or one already dropped (see ``max_steps_kept``).
        """
        with self._lock:
            return dict(self._step_totals.get(self._step if step is None else int(step), {}))

    def steps(self) -> list[int]:
        """Steps whose per-step totals are still kept, oldest first."""
        with self._lock:
            return list(self._step_totals)

    def labels(self) -> list[str]:
        """Every label with at least one record (or restored totals), in first-seen order."""
        with self._lock:
            return list(self._totals)

    def records(self) -> list[CommRecord]:
        """The last ``max_records`` calls, oldest first."""
        with self._lock:
            return list(self._records)

    def reset(self) -> None:
        """Forget everything (totals, per-step totals, records); the current step is kept."""
        with self._lock:
            self._totals.clear()
            self._step_totals.clear()
            self._records.clear()

    @contextmanager
    def capture(self) -> Iterator[ByteLedger]:
        """Yield a fresh ledger that receives a copy of every record made on this one inside the block.

        The view starts empty at this ledger's current step and keeps its contents after the block ends, so tests
        can assert on exactly what a piece of code communicated::

            with get_ledger().capture() as seen:
                all_reduce(tensor, label=INTER)
            assert seen.totals(INTER).calls == 1

        Captures nest; records still go into this ledger as usual.
        """
        view = ByteLedger(max_records=self.max_records, max_steps_kept=self.max_steps_kept)
        with self._lock:
            view.set_step(self._step)
            self._captures.append(view)
        try:
            yield view
        finally:
            with self._lock:
                self._captures.remove(view)

    # ---------------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Cumulative totals per label and the current step (per-step totals and records are not saved)."""
        with self._lock:
            return {
                "version": _STATE_VERSION,
                "step": self._step,
                "totals": {label: totals.to_dict() for label, totals in self._totals.items()},
            }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the cumulative totals and step with those of :meth:`state_dict`; per-step data is cleared."""
        version = state_dict.get("version", _STATE_VERSION)
        if version != _STATE_VERSION:
            raise ValueError(f"Unsupported ByteLedger state version {version!r} (expected {_STATE_VERSION}).")
        totals = {
            validate_label(label): LedgerTotals(int(v["sent"]), int(v["received"]), int(v["calls"]))
            for label, v in state_dict.get("totals", {}).items()
        }
        with self._lock:
            self.reset()
            self._totals.update(totals)
            self._step = int(state_dict.get("step", self._step))

    def __repr__(self) -> str:
        with self._lock:
            body = ", ".join(f"{label}={t}" for label, t in self._totals.items())
        return f"{type(self).__name__}(step={self._step}, {body or 'empty'})"


# ---------------------------------------------------------------------------------------- the counting rule
def wire_bytes(
    op: str,
    payload_bytes: int,
    group_size: int,
    *,
    rank: int = 0,
    src: int = 0,
    output_bytes: int | None = None,
    own_block_bytes: int | None = None,
) -> tuple[int, int]:
    """Bytes ``(sent, received)`` this rank puts on / takes off the wire under the documented counting rule.

    Args:
        op: One of :data:`COUNTED_OPS`.
        payload_bytes: ``S``: the tensor for all_reduce/broadcast/send/recv, this rank's input for all_gather, the
            full input for reduce_scatter_tensor, this rank's input for all_to_all_single.
        group_size: ``n``, ranks in the process group.
        rank: This rank (only compared with ``src`` for broadcast).
        src: The broadcast root.
        output_bytes: all_to_all_single only: bytes of this rank's output (default ``payload_bytes``).
        own_block_bytes: all_to_all_single only: bytes this rank sends to itself (default ``payload_bytes // n``).

    Returns:
        ``(sent, received)`` in bytes.

    Raises:
        ValueError: Unknown op, negative payload or group size below 1.
    """
    if op not in COUNTED_OPS:
        raise ValueError(f"Unknown collective {op!r}; expected one of {sorted(COUNTED_OPS)}.")
    if payload_bytes < 0 or group_size < 1:
        raise ValueError(f"Need payload_bytes >= 0 and group_size >= 1, got {payload_bytes} and {group_size}.")
    n, s = group_size, payload_bytes
    if n == 1:
        return 0, 0
    if op == "all_reduce":
        both = 2 * (n - 1) * s // n  # ring: reduce-scatter then all-gather, (n-1)/n of S each
        return both, both
    if op in ("all_gather", "all_gather_into_tensor"):
        return (n - 1) * s, (n - 1) * s
    if op == "reduce_scatter_tensor":
        return (n - 1) * s // n, (n - 1) * s // n
    if op == "broadcast":
        return ((n - 1) * s, 0) if rank == src else (0, s)
    if op in ("send", "isend"):
        return s, 0
    if op in ("recv", "irecv"):
        return 0, s
    own = s // n if own_block_bytes is None else own_block_bytes  # all_to_all_single
    out = s if output_bytes is None else output_bytes
    return s - own, out - own


_GLOBAL_LEDGER = ByteLedger()


def get_ledger() -> ByteLedger:
    """The process-global ledger that collectives record into when no ``ledger=`` is passed."""
    return _GLOBAL_LEDGER
