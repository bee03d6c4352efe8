"""Dense-value replicators: the same coordinates on every replica, so no indices travel.

- :class:`RandomReplicator`: a pseudo-random subset of coordinates each step, derived from ``(seed, parameter,
  step)`` alone, so every replica selects the same set without communicating.
- :class:`StridingReplicator`: every ``P``-th coordinate with an offset that rotates by one each step.
- :class:`FullReplicator`: every coordinate (the full-sync baseline in the same code path).

Each parameter (flattened local shard of ``N`` elements) sends ``k = max(1, floor(kept_fraction * N))`` slots per step.
Random and Striding cover the coordinates in cycles of ``P = ceil(N / k)`` steps; within a cycle every coordinate is
sent exactly once (slots beyond ``N`` in the last step of a cycle carry zeros and are ignored, so the payload has the
same size every step). Values travel as fp32/bf16 in one ``all_reduce(sum)`` per bucket (traffic independent of the
number of replicas), or, for ``values="sign"``/``"ternary"`` (which cannot be summed packed), as packed bytes in one
``all_gather`` with one fp32 scale per parameter; the decode is then a rank-ordered sum. The combination is the mean
over replicas at the selected coordinates and zero elsewhere. Random and Striding apply error feedback (the
dequantized sent values are subtracted from the buffer at the selected coordinates; with fp32 values that zeroes
them exactly). Full averages the gradient itself (:attr:`~Replicator.exchanges_gradient`), so there is nothing to
feed back.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

import torch

from lightning_hetero.comm.payload_packing import dequantize_values, pack_values, unpack_peer_values, value_nbytes
from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError
from lightning_hetero.replication.base import Piece, Replicator, check_combined, kept_count

__all__ = ["FullReplicator", "RandomReplicator", "StridingReplicator", "coordinate_schedule"]


def _where(piece: Piece) -> str:
    return f" for parameter piece {piece.key}"


class _DenseValueReplicator(Replicator):
    """Shared wire format: a fixed number of value slots per parameter, reduced densely or gathered packed."""

    @property
    def wire_kind(self) -> str:
        """``"reduce"`` for fp32/bf16 values, ``"gather"`` for sign/ternary."""
        return "reduce" if self.values in ("fp32", "bf16") else "gather"

    def _slots(self, numel: int) -> int:
        return kept_count(self.kept_fraction, numel)

    def payload_bytes(self, local_shapes: Sequence[torch.Size | tuple[int, ...]]) -> int:
        """Sum over parameters of the packed slot values (one scale per parameter for sign/ternary)."""
        total = 0
        for shape in local_shapes:
            slots = self._slots(math.prod(shape))
            total += value_nbytes(slots, self.values, 1 if slots else 0)
        return total

    def _wire(self, slot_values: torch.Tensor) -> torch.Tensor:
        if not slot_values.numel():
            return torch.empty(0, dtype=self._wire_dtype(), device=slot_values.device)
        if self.values == "fp32":
            return slot_values.float().clone()
        if self.values == "bf16":
            return slot_values.to(torch.bfloat16)
        return pack_values(slot_values.reshape(1, -1), self.values)

    def _wire_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16}.get(self.values, torch.uint8)

    def decode_reduced(self, piece: Piece, summed: torch.Tensor) -> torch.Tensor:
        """Mean over replicas of the slot values, placed back at their coordinates.

        Raises:
            PeerPayloadError: The sum is non-finite or its mean is above ``MAX_PEER_MAGNITUDE`` (no single sender
                can be named: the all-reduce hands over the sum only).
        """
        mean = summed.float() / self.num_replicas
        if bool((mean.abs() <= MAX_PEER_MAGNITUDE).all()):  # the common case, one sync; NaN compares False
            return self._expand(piece, mean)
        if not bool(torch.isfinite(summed).all()):
            raise PeerPayloadError(
                f"the replicas' all-reduced values for parameter piece {piece.key} are non-finite: some replica sent "
                "NaN/Inf; refusing to apply them (check the replicas' losses, or restart from the last checkpoint).",
                None,
                "combined",
            )
        check_combined(mean, piece.key, "the replicas' all-reduced values")  # raises: above the bound
        return self._expand(piece, mean)

    def _combine_gathered(self, piece: Piece, per_rank: list[torch.Tensor], ranks: list[int]) -> torch.Tensor:
        """Rank-ordered sum of every rank's validated, dequantized slot values, divided by the number of replicas."""
        slots = piece.meta["slots"]
        total = torch.zeros(slots, dtype=torch.float32, device=piece.wire.device)
        for rank, data in zip(ranks, per_rank, strict=True):
            values = unpack_peer_values(
                data, 1 if slots else 0, slots, self.values, peer=rank, sender=f"replica {rank}", where=_where(piece)
            )
            total += values.reshape(-1).to(total.device)
        return self._expand(piece, total / len(per_rank))

    def _expand(self, piece: Piece, slot_means: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def coordinate_schedule(
    kind: str,
    numel: int,
    slots: int,
    step: int,
    *,
    seed: int = 0,
    key: int = 0,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The coordinates a Random or Striding replicator sends at ``step``, identical on every replica.

    Args:
        kind: ``"random"`` or ``"striding"``.
        numel: Elements of the flattened local tensor.
        slots: Slots per step (``k``).
        step: Optimizer step.
        seed: Random only: the replicator seed.
        key: Random only: the parameter's position (different parameters get different draws).
        device: Where to build the index tensors (the draw itself is host-side Python, so it is device-independent).

    Returns:
        ``(slot_ids, coordinates)`` (int64, on ``device``): which of the ``k`` slots are used and the flat
        coordinate each carries. With ``P = ceil(numel / k)`` steps per cycle, every coordinate appears exactly
        once per cycle.
        Striding sends ``{phase + P * t}`` with ``phase = step mod P``. Random draws, per cycle, a permutation
        ``t -> (a * t + b) mod numel`` (``a`` coprime to ``numel`` and ``b`` drawn from a generator seeded with
        ``(seed, key, cycle)``) and sends positions ``phase * k .. phase * k + k - 1`` of it; a cheap O(k) draw
        that needs no stored state beyond the step counter (a full random permutation would cost O(numel) memory).
    """
    if numel <= 0 or slots <= 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty
    period = -(-numel // slots)
    phase = step % period
    slot_ids = torch.arange(slots, dtype=torch.int64, device=device)
    if kind == "striding":
        coordinates = phase + period * slot_ids
        used = coordinates < numel
        return slot_ids[used], coordinates[used]
    if kind != "random":
        raise ValueError(f"kind must be 'random' or 'striding', got {kind!r}.")
    positions = phase * slots + slot_ids
    used = positions < numel
    rng = random.Random(f"flexdemo-random:{seed}:{key}:{step // period}")  # str seeds hash stably (sha512)
    multiplier = 1
    if numel > 2:
        multiplier = rng.randrange(1, numel)
        while math.gcd(multiplier, numel) != 1:
            multiplier = rng.randrange(1, numel)
    offset = rng.randrange(numel)
    return slot_ids[used], (positions[used] * multiplier + offset) % numel


class _ScheduledReplicator(_DenseValueReplicator):
    """Random / Striding: send the scheduled coordinates of the local buffer, with error feedback."""

    schedule_kind = ""

    def encode(self, key: int, source: torch.Tensor) -> Piece:
        """Gather the scheduled coordinates of ``source`` into slots; subtract what was sent from ``source``."""
        started = time.perf_counter()
        shape, flat = tuple(source.shape), source.view(-1)
        slots = self._slots(flat.numel())
        slot_ids, coordinates = coordinate_schedule(
            self.schedule_kind, flat.numel(), slots, self.step, seed=self.seed, key=key, device=source.device
        )
        slot_values = torch.zeros(slots, dtype=torch.float32, device=source.device)
        slot_values[slot_ids] = flat[coordinates].float()
        wire = self._wire(slot_values)
        if slots:
            sent = dequantize_values(slot_values.reshape(1, -1), self.values).reshape(-1)
            flat.index_add_(0, coordinates, sent[slot_ids], alpha=-1)
        self.stats["encode_seconds"] += time.perf_counter() - started
        return Piece(key, shape, wire, {"slots": slots, "slot_ids": slot_ids, "coordinates": coordinates})

    def _expand(self, piece: Piece, slot_means: torch.Tensor) -> torch.Tensor:
        combined = torch.zeros(math.prod(piece.shape), dtype=torch.float32, device=slot_means.device)
        combined[piece.meta["coordinates"]] = slot_means[piece.meta["slot_ids"]]
        return combined.view(piece.shape)


class RandomReplicator(_ScheduledReplicator):
    """Shared-seed pseudo-random coordinates, dense exchange of just their values (no indices sent).

    Args:
        kept_fraction: Fraction of each parameter's coordinates sent per step.
        values: ``"fp32"``/``"bf16"`` (all_reduce) or ``"sign"``/``"ternary"`` (all_gather, one scale per tensor).
        seed: Shared seed; the selection depends only on ``(seed, parameter position, step)``.
    """

    name = "random"
    schedule_kind = "random"


class StridingReplicator(_ScheduledReplicator):
    """Every ``P``-th coordinate with a rotating offset: full coverage every ``ceil(N / k)`` steps.

    Args:
        kept_fraction: Fraction of each parameter's coordinates sent per step.
        values: As for :class:`RandomReplicator`.
        seed: Unused.
    """

    name = "striding"
    schedule_kind = "striding"


class FullReplicator(_DenseValueReplicator):
    """Dense mean of the local gradients over replicas: the full-sync baseline (``kept_fraction`` is ignored).

    With fp32 values the optimizer state then evolves exactly as a single optimizer on the replica-mean gradient
    (``DecoupledAdamW`` + Full == ``torch.optim.AdamW`` on the mean gradient). bf16/sign/ternary values quantize
    the gradient without error feedback.
    """

    name = "full"
    compresses = False
    exchanges_gradient = True

    def _slots(self, numel: int) -> int:
        return numel

    def encode(self, key: int, source: torch.Tensor) -> Piece:
        """The whole flattened tensor in the wire encoding."""
        flat = source.reshape(-1)
        return Piece(key, tuple(source.shape), self._wire(flat), {"slots": flat.numel()})

    def _expand(self, piece: Piece, slot_means: torch.Tensor) -> torch.Tensor:
        return slot_means.reshape(piece.shape)
