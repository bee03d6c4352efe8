"""Batch shares for unequal speed: each rank's micro-batch in proportion to its throughput, the aggregate weighted
by tokens, so that one step still equals the mean gradient over the whole global batch.

Pure and framework-free (torch's ``Sampler`` only); the Lightning strategies call it (``docs/batch_share.md``):

- :func:`micro_batch_sizes`: integer sizes proportional to throughputs that sum exactly to the global batch
  (largest-remainder rounding, each at least ``minimum``), the same on every rank;
- :func:`plan_micro_batches`: from the ``batch_share`` setting (shares per rank or per node, or measured
  throughputs) to one size per rank, equal inside each group of ranks that must keep pace (a FlexDeMo model copy);
- :class:`ShareBatchSampler`: every step one global batch of ``sum(sizes)`` indices from one seeded order per epoch
  (the same on every rank), of which rank ``r`` takes its contiguous slice;
- :func:`token_weights` and :func:`gradient_scale`: the weights that make the combined gradient the token-weighted
  mean. A rank's tokens are its micro-batch size in samples (every sample counts the same: fixed-length sequences;
  padding is not discounted).

Why the weighting is exact: let rank ``r`` compute ``g_r``, the mean gradient over its ``n_r`` samples, and
``N = sum n_r``. The gradient of the mean loss over the global batch is ``sum_r n_r g_r / N``. A mean all-reduce
over ``W`` ranks of ``s_r g_r`` with ``s_r = W n_r / N`` (:func:`gradient_scale`) gives exactly that; a weighted
mean ``sum w_r g_r / sum w_r`` with ``w_r = n_r`` (:func:`token_weights`) gives it too, and over a subset of ranks
(a MatFormer region) it gives the token-weighted mean among the ranks that hold the region.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence, Sized
from typing import Any, Literal

import torch
from torch.utils.data import Sampler

__all__ = [
    "AUTO",
    "BatchShare",
    "ShareBatchSampler",
    "SharedOrder",
    "check_batch_share",
    "expand_shares",
    "gradient_scale",
    "micro_batch_sizes",
    "plan_micro_batches",
    "token_weights",
]

AUTO = "auto"
"""``batch_share="auto"``: every rank measures its own throughput at fit start."""

BatchShare = Literal["auto"] | tuple[float, ...] | None
"""The ``batch_share`` setting: None (every rank the loader's ``batch_size``), ``"auto"`` (measured), or one share
per rank or per node (any positive numbers; only their ratios count)."""


# ---------------------------------------------------------------------------------------------------- sizes
def _check_positive_numbers(name: str, values: Any) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{name}={values!r}: give a non-empty list of positive numbers.")
    out = []
    for index, value in enumerate(values):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={list(values)}: entry {index} ({value!r}) must be a finite number > 0.")
        out.append(float(value))
    return out


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: use an int >= {minimum}.")
    return value


def micro_batch_sizes(throughputs: Sequence[float], global_batch: int, *, minimum: int = 1) -> list[int]:
    """Integer micro-batch sizes proportional to ``throughputs`` that sum exactly to ``global_batch``.

    The ideal size of rank ``i`` is ``global_batch * t_i / sum(t)``. Ranks whose ideal is below ``minimum`` get
    ``minimum`` and the rest is shared among the others in the same proportion (repeated until none is below).
    Each remaining size is the floor of its ideal; the samples left over go one each to the largest fractional
    parts (ties: the lower index). Deterministic: every rank computes the same sizes from the same inputs.

    Args:
        throughputs: One finite number > 0 per rank (samples per second, or any share: only ratios count).
        global_batch: Samples per step over all ranks, at least ``minimum * len(throughputs)``.
        minimum: The smallest micro-batch (>= 1).

    Returns:
        One size per rank, each >= ``minimum``, summing to ``global_batch``.

    Raises:
        ValueError: A throughput that is not finite and > 0, an empty list, or a ``global_batch`` or ``minimum``
            that is not an int in range (the message names the argument).
    """
    rates = _check_positive_numbers("throughputs", throughputs)
    _check_count("minimum", minimum, 1)
    _check_count("global_batch", global_batch, 1)
    if global_batch < minimum * len(rates):
        raise ValueError(
            f"global_batch={global_batch}: {len(rates)} ranks need at least minimum={minimum} samples each "
            f"({minimum * len(rates)}); use a larger batch_size or a smaller minimum."
        )
    clamped: set[int] = set()
    while True:
        free = [i for i in range(len(rates)) if i not in clamped]
        left = global_batch - minimum * len(clamped)
        total = math.fsum(rates[i] for i in free)
        ideal = {i: left * rates[i] / total for i in free}
        below = {i for i in free if ideal[i] < minimum}
        if not below:
            break
        clamped |= below
    sizes = [minimum] * len(rates)
    for i in free:
        sizes[i] = int(math.floor(ideal[i]))
    short = global_batch - sum(sizes)
    order = sorted(free, key=lambda i: (-(ideal[i] - math.floor(ideal[i])), i))
    for i in order[:short]:
        sizes[i] += 1
    return sizes


def expand_shares(shares: Sequence[float], world_size: int, num_nodes: int = 1) -> list[float]:
    """One share per global rank: given per rank, or per node (each of a node's ranks gets ``share / ranks``).

    Raises:
        ValueError: The number of shares fits neither the ranks nor the nodes, or a share is not finite and > 0.
    """
    values = _check_positive_numbers("batch_share", shares)
    if len(values) == world_size:
        return values
    if num_nodes >= 1 and len(values) == num_nodes and world_size % num_nodes == 0:
        per_node = world_size // num_nodes
        return [share / per_node for share in values for _ in range(per_node)]
    raise ValueError(
        f"batch_share={list(shares)} has {len(values)} entries, but the run has {world_size} ranks on {num_nodes} "
        f"node(s): give one share per rank ({world_size}) or per node ({num_nodes}), or 'auto'."
    )


def plan_micro_batches(rates: Sequence[float], batch_size: int, *, group_size: int = 1, minimum: int = 1) -> list[int]:
    """One micro-batch size per rank from per-rank rates; the global batch is ``len(rates) * batch_size``.

    Consecutive groups of ``group_size`` ranks (a FlexDeMo model copy, whose ranks shard one model and so keep
    pace with each other) get one size each, from the group's summed rate; so ``batch_size`` stays the mean
    micro-batch and the global batch is what the run had without shares.

    Args:
        rates: One finite number > 0 per rank: measured samples per second, or shares (:func:`expand_shares`).
        batch_size: The loader's batch size (the mean micro-batch).
        group_size: Ranks per group (divides ``len(rates)``).
        minimum: The smallest micro-batch.

    Raises:
        ValueError: Bad rates, a ``group_size`` that does not divide the ranks, or a batch too small for them.
    """
    values = _check_positive_numbers("rates", rates)
    _check_count("batch_size", batch_size, 1)
    _check_count("group_size", group_size, 1)
    if len(values) % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {len(values)} ranks; use a divisor.")
    groups = [math.fsum(values[g : g + group_size]) for g in range(0, len(values), group_size)]
    sizes = micro_batch_sizes(groups, len(groups) * batch_size, minimum=minimum)
    return [size for size in sizes for _ in range(group_size)]


def token_weights(sizes: Sequence[int]) -> list[float]:
    """Each rank's weight in the token-weighted mean: ``n_r / sum(n)`` (sums to 1)."""
    counts = [_check_count("sizes", size, 1) for size in sizes]
    total = sum(counts)
    return [count / total for count in counts]


def gradient_scale(sizes: Sequence[int], rank: int) -> float:
    """The factor on rank ``rank``'s local mean gradient so that a plain mean all-reduce over all ranks gives the
    token-weighted mean: ``W * n_rank / sum(n)`` (1.0 when every size is equal)."""
    weights = token_weights(sizes)
    if not 0 <= rank < len(weights):
        raise ValueError(f"rank={rank}: use 0 <= rank < {len(weights)}.")
    return len(weights) * weights[rank]


def check_batch_share(owner: str, value: Any) -> BatchShare:
    """Validate a ``batch_share`` setting; returns it normalised (a tuple of floats, ``"auto"`` or None).

    Raises:
        ValueError: Anything else, naming ``<owner>.batch_share`` and the accepted values.
    """
    if value is None or value == AUTO:
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(
            f"{owner}.batch_share={value!r}: use 'auto' (measured at fit start), a list of shares (one per rank or "
            "per node, e.g. [0.75, 0.25]), or None."
        )
    try:
        return tuple(_check_positive_numbers("batch_share", value))
    except ValueError as error:
        raise ValueError(f"{owner}.{error} Shares are relative speeds, e.g. [0.75, 0.25] or [3, 1].") from None


# ---------------------------------------------------------------------------------------------------- sampler
class SharedOrder(Sampler[int]):
    """The order of one epoch over ``range(length)``, the same on every rank: ``torch.randperm`` seeded by
    ``seed + epoch`` (as ``DistributedSampler``, so that a share run draws the same global batches as a DDP run of
    the same seed), or ``0, 1, ...`` without shuffling.

    Args:
        length: Samples in the dataset.
        shuffle: Shuffle each epoch.
        seed: Base seed.
    """

    def __init__(self, length: int, *, shuffle: bool = True, seed: int = 0) -> None:
        self.length = _check_count("length", length, 0)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch``."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())


class ShareBatchSampler(Sampler[list[int]]):
    """Rank ``rank``'s micro-batches: per step one global batch of ``sum(sizes)`` indices, this rank's slice of it.

    Every rank iterates the same order (``source``) and cuts it into global batches of ``sum(sizes)``; rank ``r``
    yields ``batch[offset_r : offset_r + sizes[r]]`` with ``offset_r = sum(sizes[:r])``. So every rank yields the
    same number of batches, and in one epoch no two ranks see the same sample. With ``drop_last`` an incomplete
    final global batch is dropped; without it the order is padded from its start (as ``DistributedSampler`` pads),
    so every step keeps the sizes the weights assume and the first few samples are seen twice in that epoch.

    Args:
        source: The dataset length (a :class:`SharedOrder` is built), a sized dataset, or a sampler that yields the
            same order on every rank (give it ``set_epoch`` for a new order per epoch).
        sizes: Every rank's micro-batch size (ints >= 1), from :func:`plan_micro_batches`.
        rank: This rank.
        seed: Base seed of the shuffle (``source`` given as a length or a dataset).
        shuffle: Shuffle each epoch (``source`` given as a length or a dataset).
        drop_last: Drop an incomplete final global batch instead of padding it.

    Raises:
        ValueError: ``sizes`` empty or not ints >= 1, or ``rank`` out of range.
    """

    def __init__(
        self,
        source: int | Sized,
        sizes: Sequence[int],
        rank: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
            raise ValueError(f"sizes={sizes!r}: give one micro-batch size (int >= 1) per rank.")
        self.sizes = tuple(_check_count("sizes", size, 1) for size in sizes)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self.sizes):
            raise ValueError(f"rank={rank!r}: use 0 <= rank < {len(self.sizes)} (one size per rank).")
        if isinstance(source, int) and not isinstance(source, bool):
            self.sampler: Any = SharedOrder(source, shuffle=shuffle, seed=seed)
        elif isinstance(source, Sampler):
            self.sampler = source
        elif isinstance(source, Sized):
            self.sampler = SharedOrder(len(source), shuffle=shuffle, seed=seed)
        else:
            raise ValueError(f"source={source!r}: give the dataset length, the dataset, or a sampler.")
        self.rank = rank
        self.drop_last = bool(drop_last)
        self.global_batch = sum(self.sizes)
        """Samples per step over all ranks (what a loader position counts, whatever this rank's share)."""
        self.offset = sum(self.sizes[:rank])
        self.micro_batch = self.sizes[rank]

    @property
    def epoch(self) -> int:
        """The epoch whose order is drawn (the source's, when it has one)."""
        return int(getattr(self.sampler, "epoch", 0))

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch`` on the source (Lightning and ``StatefulDataLoader`` call this)."""
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        samples = len(self.sampler)
        return samples // self.global_batch if self.drop_last else -(-samples // self.global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        order = list(iter(self.sampler))
        steps = len(self)
        needed = steps * self.global_batch
        if needed > len(order) and order:
            order = (order * (needed // len(order) + 1))[:needed]  # pad from the start, as DistributedSampler
        start, stop = self.offset, self.offset + self.micro_batch
        for step in range(steps):
            base = step * self.global_batch
            yield order[base + start : base + stop]
