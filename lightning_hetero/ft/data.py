"""Each replica group reads its own shard of one training set: torchft's ``DistributedSampler`` per replica group.

In the fault-tolerant mode every node is its own launch, so nothing in the launch tells a node which part of the data
is its own: without this, every node reads the same batches and the extra nodes add nothing. The shard is set by
``FaultToleranceSettings.replica_rank`` (or the trailing digits of the replica id) and ``num_replica_groups``:
torchft's sampler cuts one seeded permutation of the dataset into ``num_replica_groups x ranks per group`` disjoint
strides, so every node must use the same dataset, the same seed and the same ``num_replica_groups``.

The tail that does not divide evenly is dropped (``drop_last=True``), never padded with repeats: shards stay disjoint
and of equal length, so every node has the same number of batches per epoch and positions (epoch, batch) mean the
same place on every node. A shard whose group is away is not read meanwhile (torchft's sampler is lossy by design).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from lightning_hetero.ft._deps import require_torchft
from lightning_hetero.ft.settings import FaultToleranceSettings

__all__ = ["replica_group_sampler"]


def replica_group_sampler(
    dataset: Sized,
    settings: FaultToleranceSettings,
    *,
    group_rank: int = 0,
    group_size: int = 1,
    shuffle: bool = True,
    seed: int = 0,
) -> Any:
    """torchft's ``DistributedSampler`` for this rank of this replica group (``set_epoch`` reshuffles per epoch).

    Args:
        dataset: The whole training set (map-style, sized), the same on every node.
        settings: ``num_replica_groups`` (required here) and the replica group's index.
        group_rank: This rank inside its replica group.
        group_size: Ranks per replica group.
        shuffle: Shuffle by ``seed + epoch`` (the same permutation on every node, cut into disjoint shards).
        seed: The data seed, the same on every node (a different seed per node would make the shards overlap).

    Raises:
        ValueError: ``num_replica_groups`` is None, the group index is out of range, or the dataset is too small for
            one sample per shard.
    """
    if settings.num_replica_groups is None:
        raise ValueError(
            f"{settings.OWNER}.num_replica_groups is None: set it to the number of replica groups (nodes) of the job "
            "so that each reads its own shard of the training set (docs/spot.md)."
        )
    shards = settings.num_replica_groups * group_size
    if len(dataset) < shards:
        raise ValueError(
            f"{settings.OWNER}.num_replica_groups={settings.num_replica_groups}: the training set has {len(dataset)} "
            f"samples, fewer than the {shards} shards (groups x ranks per group); use fewer groups or more data."
        )
    require_torchft()
    from torchft.data import DistributedSampler

    return DistributedSampler(
        dataset,
        replica_rank=settings.resolve_replica_rank(),
        num_replica_groups=settings.num_replica_groups,
        group_rank=group_rank,
        num_replicas=group_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=True,
    )
