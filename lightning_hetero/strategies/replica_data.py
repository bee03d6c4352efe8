"""The train loader of a fault-tolerant node (FlexDeMo, MatFormer; ``docs/spot.md``): its own shard, and the checkpoint
it keeps when too few nodes stay.

- :func:`shard_train_loader`: the Trainer's train loader rebuilt around
  :func:`~lightning_hetero.ft.data.replica_group_sampler` (torchft's ``DistributedSampler`` over replica groups), so
  every node reads its own disjoint shard of one training set.
- :func:`save_below_minimum_checkpoint`: the verified checkpoint a node saves when too few replica groups stayed for
  too long. (Following a peer's position after a heal is :mod:`lightning_hetero.strategies.trainer_position`.)
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightning_hetero.data.stateful import StatefulDataLoader
from lightning_hetero.ft.data import replica_group_sampler
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.ft.waiting import ReplicasBelowMinimumError
from lightning_hetero.reliability.checkpoints import verify_checkpoint, write_manifest
from lightning_hetero.strategies.trainer_position import batches_in_flight

__all__ = ["save_below_minimum_checkpoint", "shard_train_loader"]

log = logging.getLogger(__name__)

_warned_unsharded: set[str] = set()


def shard_train_loader(
    loader: Any, settings: FaultToleranceSettings, *, group_rank: int, group_size: int, owner: str
) -> Any:
    """``loader`` reading only this replica group's (and rank's) shard; unchanged without ``num_replica_groups``.

    The shuffle follows the loader (a ``RandomSampler``, or the ``DistributedSampler`` Lightning put in, shuffles);
    the seed is the loader's ``seed`` (a :class:`StatefulDataLoader`'s, i.e. the DataModule's data seed) or the
    sampler's, and must be the same on every node.

    Raises:
        ValueError: The loader cannot be re-cut by index (an iterable dataset, a custom sampler or batch sampler),
            naming ``num_replica_groups`` and the fix.
    """
    if settings.num_replica_groups is None:
        if owner not in _warned_unsharded:
            _warned_unsharded.add(owner)
            log.warning(
                "%s (fault-tolerant mode): fault_tolerance.num_replica_groups is not set, so every node reads the "
                "whole training set in the same order and the extra nodes add no data. Set num_replica_groups to "
                "the number of nodes (each reads its own shard; docs/spot.md).",
                owner,
            )
        return loader
    where = f"{owner}(settings.fault_tolerance.num_replica_groups={settings.num_replica_groups})"
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"{where}: the train loader ({type(loader).__name__}) has no index to cut into per-node shards. Use a "
            "map-style dataset in a DataLoader, or shard the stream yourself and set num_replica_groups=None."
        )
    sampler = loader.sampler
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        raise ValueError(
            f"{where}: the train loader has its own batch sampler ({type(loader.batch_sampler).__name__}); "
            "per-node shards need the plain one. Drop it, or shard yourself with "
            "lightning_hetero.ft.data.replica_group_sampler and set num_replica_groups=None."
        )
    if isinstance(sampler, DistributedSampler):
        shuffle = bool(sampler.shuffle)
    elif isinstance(sampler, (RandomSampler, SequentialSampler)):
        shuffle = isinstance(sampler, RandomSampler)
    else:
        raise ValueError(
            f"{where}: the train loader has its own sampler ({type(sampler).__name__}); per-node shards replace it. "
            "Use shuffle=True/False instead, or shard yourself with lightning_hetero.ft.data.replica_group_sampler "
            "and set num_replica_groups=None."
        )
    seed = getattr(loader, "seed", None)
    if not isinstance(seed, int):
        seed = int(getattr(sampler, "seed", 0))
    shard = replica_group_sampler(
        loader.dataset, settings, group_rank=group_rank, group_size=group_size, shuffle=shuffle, seed=seed
    )
    rank_zero_info(
        f"{owner}: replica group {shard.global_rank // group_size} of {settings.num_replica_groups} reads its shard of "
        f"the training set ({shard.num_samples} of {len(loader.dataset)} samples per epoch and rank, seed {seed})."
    )
    return _update_dataloader(loader, shard, mode=RunningStage.TRAINING)


def save_below_minimum_checkpoint(trainer: Any, error: ReplicasBelowMinimumError) -> Path | None:
    """Save this node's last committed state next to its checkpoints, verify it, and name it in ``error``.

    The state is the last committed step's (a discarded try was undone before the quorum was asked again), with the
    batch in flight counted as not consumed, so a resumed run trains it (it was never committed). The file
    goes to the ``ModelCheckpoint`` directory (else ``<default_root_dir>/checkpoints``), gets a manifest
    (:func:`~lightning_hetero.reliability.checkpoints.write_manifest`) and is read back against it
    (:func:`~lightning_hetero.reliability.checkpoints.verify_checkpoint`). A failed save is logged and leaves
    ``error.checkpoint`` None: the error itself still ends the run.
    """
    callback = getattr(trainer, "checkpoint_callback", None)
    directory = getattr(callback, "dirpath", None) or Path(trainer.default_root_dir) / "checkpoints"
    path = Path(directory) / f"below-min-replicas-step={trainer.global_step}.ckpt"
    in_flight = batches_in_flight(trainer)
    loader = trainer.train_dataloader
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A resumed run redoes the batch in flight (the loop's counters do so by themselves; the loader must agree).
        with loader.holding_back(in_flight) if isinstance(loader, StatefulDataLoader) else nullcontext():
            trainer.save_checkpoint(path)
        write_manifest(path, step=trainer.global_step, epoch=trainer.current_epoch, reason="below min_replicas")
        verify_checkpoint(path)
    except Exception:  # the stop must still reach the user; say why no checkpoint came with it
        log.exception("saving the checkpoint before stopping (fewer than min_replicas) failed")
        return None
    error.checkpoint = str(path)
    log.error("%s", error)
    return path
