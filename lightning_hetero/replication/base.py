"""The :class:`Replicator` base: encode local tensors, exchange them over the replicate group, decode the combination.

A replicator turns one local tensor per parameter (the optimizer's update buffer, or the raw gradient for
:attr:`Replicator.exchanges_gradient` replicators) into a :class:`Piece` (its wire bytes plus what is needed to decode
it), starts one collective for a whole bucket of pieces (:meth:`Replicator.launch`), and later waits and decodes
(:meth:`Replicator.finish`) into one combined float32 tensor per parameter, identical on every replica. Two wire kinds:

- ``"gather"``: every piece is packed bytes (uint8); the bucket is one ``all_gather_into_tensor`` and each replica
  decodes every rank's bytes and sums them **in rank order 0..n-1** (deterministic, so replicas stay bit-identical);
- ``"reduce"``: every piece is a dense float vector (fp32 or bf16); the bucket is one ``all_reduce(sum)``, which
  hands every rank the same sum.

Buckets contain the same parameters in the same order on every replica (the optimizer guarantees it), so their byte
layout is identical everywhere and no header is sent. Every decode keeps the peer-payload rule of
:mod:`lightning_hetero.comm.validation`: each rank's bytes are validated field by field (the validating codecs
:func:`~lightning_hetero.comm.payload_packing.unpack_peer_indices` /
:func:`~lightning_hetero.comm.payload_packing.unpack_peer_values`),
and the combination is checked again (finite, magnitude at most ``MAX_PEER_MAGNITUDE``: values finite alone can sum
past fp32's range, and an inverse DCT adds up a block's coefficients) before it is handed to the optimizer; anything
else raises :class:`PeerPayloadError` naming the replica (when one can be named) and the field. A group of one (or
no group: an unbound optimizer) sends nothing and decodes its own piece. Every collective is counted by
:mod:`lightning_hetero.comm` as ``"inter"``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_hetero import comm
from lightning_hetero.comm.payload_packing import validate_value_encoding
from lightning_hetero.comm.timing import union_seconds, wall_clock
from lightning_hetero.comm.validation import (
    MAX_PEER_MAGNITUDE,
    PeerPayloadError,
    peer_decoding,
    report_dropped,
    validate_on_bad_payload,
)

__all__ = [
    "Bucket",
    "Piece",
    "Replicator",
    "check_combined",
    "kept_count",
    "validate_kept_fraction",
]


def validate_kept_fraction(kept_fraction: object) -> float:
    """Return ``kept_fraction`` as a float in ``(0, 1]`` or raise a ValueError naming the argument."""
    if isinstance(kept_fraction, bool) or not isinstance(kept_fraction, (int, float)) or not 0 < kept_fraction <= 1:
        raise ValueError(
            f"kept_fraction must be a number in (0, 1] (the fraction of coefficients kept, e.g. 1/32 = 0.03125),"
            f" got {kept_fraction!r}."
        )
    return float(kept_fraction)


def kept_count(kept_fraction: float, size: int) -> int:
    """Coefficients kept out of ``size``: ``floor(kept_fraction * size)``, at least 1 (0 if empty)."""
    if size <= 0:
        return 0
    return max(1, min(size, int(kept_fraction * size + 1e-9)))  # the epsilon absorbs 0.07 * 100 = 7.000000000000001


@dataclass
class Piece:
    """One parameter's contribution to a bucket."""

    key: int
    """The parameter's position in the optimizer (same on every replica)."""
    shape: tuple[int, ...]
    """Local shape of the tensor that was encoded (the combined result has this shape)."""
    wire: torch.Tensor
    """1-D wire data: uint8 bytes (gather kind) or a float vector (reduce kind); may be empty."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Whatever the replicator needs to decode (layout, selected positions, ...)."""


@dataclass
class Bucket:
    """A launched collective over several pieces."""

    pieces: list[Piece]
    kind: str
    buffer: torch.Tensor
    output: torch.Tensor
    work: Any | None
    launched_at: float
    """:func:`~lightning_hetero.comm.timing.wall_clock` reading when the exchange started."""
    early: bool
    offsets: list[int]
    completed_at: float | None = None
    """For an exchange that already finished when ``launch`` returned (synchronous, nothing overlaps it): the
    :func:`~lightning_hetero.comm.timing.wall_clock` reading at its end, all of it counted as waited."""

    def __post_init__(self) -> None:
        if not self.launched_at > 0.0:
            raise ValueError(
                f"Bucket.launched_at must be a wall_clock() reading taken before the exchange, got {self.launched_at}."
            )


def check_combined(combined: torch.Tensor, key: int, source: str, peer: int | None = None) -> None:
    """Refuse a combined update for piece ``key`` that is non-finite or above ``MAX_PEER_MAGNITUDE``.

    Args:
        combined: What the optimizer would apply.
        key: The parameter piece.
        source: Who produced it, for the message (``"replica 2"``, ``"the replicas' all-reduced values"``).
        peer: The replica to name in the error when a single one produced it.
    """
    if not combined.numel() or bool((combined.abs() <= MAX_PEER_MAGNITUDE).all()):  # one sync; NaN compares False
        return
    field = "values" if peer is not None else "combined"
    if not bool(torch.isfinite(combined).all()):
        raise PeerPayloadError(
            f"{source} decode to non-finite values for parameter piece {key}; refusing to apply them (a corrupt or"
            " hostile peer: finite values can still sum past fp32's range).",
            peer,
            field,
        )
    raise PeerPayloadError(
        f"{source} decode to an update of magnitude {float(combined.abs().max()):.3g} for parameter piece {key}, above"
        f" the bound {MAX_PEER_MAGNITUDE:.3g} that no healthy run reaches; refusing to apply it.",
        peer,
        field,
    )


class Replicator(ABC):
    """Exchange (compressed) local tensors over the replicate group; decode one combined tensor per parameter.

    Args:
        kept_fraction: Fraction of coefficients kept, in ``(0, 1]``.
        values: Value encoding on the wire: ``"fp32"``, ``"bf16"``, ``"sign"`` (1 bit + per-row scale) or
            ``"ternary"`` (2 bits + per-row scale); see :mod:`lightning_hetero.comm.payload_packing`.
        seed: Seed of replicators that select coordinates pseudo-randomly (the same on every replica).
    """

    name: ClassVar[str] = ""
    compresses: ClassVar[bool] = True
    """False for replicators that send everything (Full, DiLoCo); the strategy warns when a compressing replicator
    runs with a single replica, where compression only loses information."""
    exchanges_gradient: ClassVar[bool] = False
    """True: the optimizer hands over the raw local gradient and runs its state recursion on the combined gradient
    (Full, DiLoCo). False: it hands over its local update buffer, which the replicator compresses with error
    feedback (what was sent is subtracted from the buffer in place)."""

    def __init__(self, kept_fraction: float = 1 / 32, *, values: str = "fp32", seed: int = 0) -> None:
        self.kept_fraction = validate_kept_fraction(kept_fraction)
        self.values = validate_value_encoding(values)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}.")
        self.seed = seed
        self.group: Any | None = None
        self.num_replicas = 1
        self.step = 0
        """Optimizer steps completed (advanced by :meth:`end_step`; saved in :meth:`state_dict`)."""
        self._owner: object | None = None
        self.stats: dict[str, float] = {}
        self._reset_stats()
        self.on_bad_payload = "raise"
        """``"raise"``: a corrupt replica payload stops training; ``"drop"``: it is left out of the combination."""
        self.dropped_payloads = 0
        """Payloads left out under ``on_bad_payload="drop"`` since construction."""
        self.collectives: Any | None = None
        """None: :meth:`launch` runs its collective on :attr:`group`. Otherwise an object whose
        ``launch(replicator, pieces, early=...)`` returns the completed :class:`Bucket` instead (the fault-tolerant
        mode's :class:`~lightning_hetero.ft.replicas.FaultTolerantReplica`, whose group changes with every quorum)."""

    def set_bad_payload_policy(self, policy: str) -> None:
        """Choose ``"raise"`` or ``"drop"`` for corrupt replica payloads (:mod:`lightning_hetero.comm.validation`)."""
        self.on_bad_payload = validate_on_bad_payload(type(self).__name__, policy)

    # ----------------------------------------------------------------------------------------------- set up
    def setup(self, group: Any | None) -> None:
        """Use ``group`` as the replicate group (None: a single replica, nothing is ever sent)."""
        if group is not None and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("A replicate group was given but torch.distributed is not initialized.")
        self.group = group
        self.num_replicas = 1 if group is None else dist.get_world_size(group)

    def attach(self, owner: object) -> None:
        """Claim this replicator for one optimizer; a replicator holds per-run state and cannot be shared."""
        if self._owner is not None and self._owner is not owner:
            raise ValueError(
                f"This {type(self).__name__} is already used by another optimizer; build one replicator per optimizer"
                " (replicators hold step counters and per-parameter state)."
            )
        self._owner = owner

    @property
    def wire_kind(self) -> str:
        """``"gather"`` (packed bytes) or ``"reduce"`` (dense float sum)."""
        return "gather"

    def describe(self) -> dict[str, Any]:
        """The configuration, for logs."""
        return {"name": self.name, "kept_fraction": self.kept_fraction, "values": self.values, "seed": self.seed}

    # ------------------------------------------------------------------------------------------ step hooks
    def start_step(self, params: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Called once per optimizer step, before the first :meth:`encode`, with every ``(key, local param)``."""
        self._reset_stats()

    def end_step(self, params: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Called once per optimizer step after every parameter was updated; advances :attr:`step`."""
        self.step += 1

    def _reset_stats(self) -> None:
        self.stats = {"wait_seconds": 0.0, "comm_seconds": 0.0, "encode_seconds": 0.0, "decode_seconds": 0.0}
        self.stats.update({"buckets": 0, "payload_bytes": 0})
        self._comm_spans: list[tuple[float, float]] = []  # [launched, completed] per bucket of this step

    # --------------------------------------------------------------------------------------- encode/decode
    @abstractmethod
    def encode(self, key: int, source: torch.Tensor) -> Piece:
        """Encode the float32 local tensor ``source``; apply error feedback to it in place where the replicator has
        it. Must produce the same wire size on every replica for the same key and shape."""

    def decode_gathered(self, piece: Piece, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """Combine every rank's bytes for ``piece`` (rank order) into a float32 tensor of ``piece.shape``.

        Raises:
            PeerPayloadError: A rank's bytes break the payload rule (naming the replica and the field), or the
                combination is non-finite or above ``MAX_PEER_MAGNITUDE`` (naming the replica whose own
                contribution is, when one is).
        """
        return self._decode_ranks(piece, per_rank, list(range(len(per_rank))))

    def _combine_gathered(self, piece: Piece, per_rank: list[torch.Tensor], ranks: list[int]) -> torch.Tensor:
        """Validate and combine the bytes of replicas ``ranks`` (``per_rank[i]`` from ``ranks[i]``): subclasses."""
        raise NotImplementedError

    def _decode_ranks(self, piece: Piece, per_rank: list[torch.Tensor], ranks: list[int]) -> torch.Tensor:
        """:meth:`_combine_gathered`, then the combined check; a failing combination is blamed on a replica whose
        own contribution fails alone (with ``combine="mean"`` one always does: the mean is a convex combination)."""
        with peer_decoding(None, f"the combined update for parameter piece {piece.key}"):
            combined = self._combine_gathered(piece, per_rank, ranks)
        if len(ranks) == 1:
            check_combined(combined, piece.key, f"replica {ranks[0]} sent values that", ranks[0])
            return combined
        try:
            check_combined(combined, piece.key, f"the values of replicas {ranks}")
        except PeerPayloadError as error:
            for data, rank in zip(per_rank, ranks, strict=True):
                try:
                    self._decode_ranks(piece, [data], [rank])
                except PeerPayloadError as alone:
                    raise alone from error
            raise
        return combined

    def decode_reduced(self, piece: Piece, summed: torch.Tensor) -> torch.Tensor:
        """Turn the all-reduced sum for ``piece`` into a float32 tensor of ``piece.shape``."""
        raise NotImplementedError

    @abstractmethod
    def payload_bytes(self, local_shapes: Sequence[torch.Size | tuple[int, ...]]) -> int:
        """Bytes this rank contributes to the inter-node collective(s) of one synchronising step (the ledger's
        ``payload_bytes`` summed over this step's ``"inter"`` records)."""

    # ---------------------------------------------------------------------------------------- communication
    def launch(self, pieces: list[Piece], *, early: bool = False) -> Bucket:
        """Concatenate ``pieces`` and start one async collective over the replicate group (none when alone/empty)."""
        if self.collectives is not None:
            return self.collectives.launch(self, pieces, early=early)
        kind = self.wire_kind
        offsets, total = [], 0
        for piece in pieces:
            offsets.append(total)
            total += piece.wire.numel()
        non_empty = [piece.wire for piece in pieces if piece.wire.numel()]
        if non_empty:
            buffer = torch.cat(non_empty) if len(non_empty) > 1 else non_empty[0].clone()  # reduced in place
        else:
            device = pieces[0].wire.device if pieces else torch.device("cpu")
            buffer = torch.empty(0, dtype=torch.uint8 if kind == "gather" else torch.float32, device=device)
        work, output = None, buffer
        launched_at = wall_clock()
        if self.num_replicas > 1 and total:
            if kind == "gather":
                output = buffer.new_empty(self.num_replicas * total)
                work = comm.all_gather_into_tensor(output, buffer, label=comm.INTER, group=self.group, async_op=True)
            else:
                work = comm.all_reduce(buffer, "sum", label=comm.INTER, group=self.group, async_op=True)
            self.stats["payload_bytes"] += buffer.numel() * buffer.element_size()
        self.stats["buckets"] += 1
        return Bucket(pieces, kind, buffer, output, work, launched_at, early, offsets)

    def finish(self, bucket: Bucket) -> list[torch.Tensor]:
        """Wait for ``bucket``'s collective and decode one combined float32 tensor per piece (same on every replica)."""
        if bucket.completed_at is not None:  # synchronous: the caller waited for all of it, nothing was hidden
            self.stats["wait_seconds"] += bucket.completed_at - bucket.launched_at
            self._comm_spans.append((bucket.launched_at, bucket.completed_at))
        elif bucket.work is not None:
            started = wall_clock()
            bucket.work.wait()
            done = wall_clock()
            self.stats["wait_seconds"] += done - started
            self._comm_spans.append((bucket.launched_at, done))
        # Time with any exchange in flight: overlapping buckets count once, so it never exceeds the step's duration.
        self.stats["comm_seconds"] = union_seconds(self._comm_spans)
        started = time.perf_counter()
        total = bucket.buffer.numel()
        results = []
        for piece, offset in zip(bucket.pieces, bucket.offsets, strict=True):
            size = piece.wire.numel()
            if bucket.kind == "gather":
                ranks = 1 if bucket.work is None else self.num_replicas
                per_rank = [bucket.output[r * total + offset : r * total + offset + size] for r in range(ranks)]
                results.append(self._decode_gathered_or_drop(piece, per_rank))
            else:
                results.append(self._decode_reduced_or_drop(piece, bucket.output[offset : offset + size]))
        self.stats["decode_seconds"] += time.perf_counter() - started
        return results

    def _decode_gathered_or_drop(self, piece: Piece, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`decode_gathered`; under ``"drop"`` a refused replica is left out and the rest are combined.

        Every replica holds the same gathered bytes, so every replica leaves out the same ranks (and stays identical).
        If the others still do not combine into a valid update (possible with ``combine="pickers"`` only), the piece
        gets a zero update this step, on every replica alike.
        """
        try:
            return self.decode_gathered(piece, per_rank)
        except PeerPayloadError as error:
            if self.on_bad_payload != "drop":
                raise
            first = error
        kept, ranks = [], []
        for rank, data in enumerate(per_rank):
            try:
                self._decode_ranks(piece, [data], [rank])
            except PeerPayloadError:
                continue
            kept.append(data)
            ranks.append(rank)
        dropped = len(per_rank) - len(kept)
        zero = torch.zeros(piece.shape, dtype=torch.float32, device=piece.wire.device)
        if not kept:
            report_dropped(first, f"piece {piece.key}: every replica's payload refused, no update this step", self)
            return zero
        try:
            combined = self._decode_ranks(piece, kept, ranks)
        except PeerPayloadError as error:
            report_dropped(
                error, f"piece {piece.key}: replicas {ranks} do not combine either, no update this step", self
            )
            return zero
        report_dropped(first, f"piece {piece.key}: combined the other {len(kept)} replica(s), left out {dropped}", self)
        return combined

    def _decode_reduced_or_drop(self, piece: Piece, summed: torch.Tensor) -> torch.Tensor:
        """:meth:`decode_reduced`; under ``"drop"`` a non-finite sum (no sender known) becomes a zero update."""
        try:
            return self.decode_reduced(piece, summed)
        except PeerPayloadError as error:
            if self.on_bad_payload != "drop":
                raise
            report_dropped(error, f"piece {piece.key}: no update this step", self)
            return torch.zeros(piece.shape, dtype=torch.float32, device=summed.device)

    # ------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything needed for a bit-identical resume (the step counter drives every pseudo-random choice)."""
        return {"name": self.name, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the replicator kind must match."""
        name = state_dict.get("name", self.name)
        if name != self.name:
            raise ValueError(f"Checkpoint holds state of replicator {name!r}, but this optimizer uses {self.name!r}.")
        self.step = int(state_dict["step"])

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "name")
        return f"{type(self).__name__}({options})"
