"""Batch share in the Trainer: the train loader's batches cut by speed (``docs/batch_share.md``).

The data-parallel strategies (FlexDeMo, MatFormer) call :class:`TrainerBatchShare` from ``process_dataloader``
while the fit loop sets up its train loader (validation, test and predict loaders are left as they are). It:

1. resolves every rank's micro-batch once per fit: from the shares given (per rank or per node), or with
   ``"auto"`` from each rank's measured samples per second (a few forward and backward passes of the
   LightningModule's ``training_step`` on one probe batch of ``batch_size`` samples, timed with
   :func:`~lightning_hetero.hetero.measure.time_call`; gathered as JSON, never pickled), the same on every rank;
2. rebuilds the loader around a :class:`~lightning_hetero.hetero.batch_share.ShareBatchSampler` (a
   :class:`~lightning_hetero.data.stateful.StatefulDataLoader` stays one, so a mid-epoch resume stays exact);
3. logs one line per rank: node, throughput, micro-batch and share.

The strategy then applies the token weights its way (FlexDeMo scales the loss, MatFormer weights each region's mean).
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping, Sequence, Sized
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.seed import isolate_rng
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_hetero.core import all_gather_json
from lightning_hetero.data.stateful import StatefulDataLoader
from lightning_hetero.hetero.batch_share import AUTO, ShareBatchSampler, expand_shares, plan_micro_batches
from lightning_hetero.hetero.measure import time_call

__all__ = ["PROBE_REPEATS", "PROBE_WARMUP", "TrainerBatchShare"]

PROBE_REPEATS = 3
"""Timed probe steps per rank under ``batch_share="auto"`` (the median counts)."""
PROBE_WARMUP = 1
"""Untimed probe steps before them."""

_MEASUREMENT = {"node": int, "throughput": (int, float)}
"""What every rank sends under ``"auto"`` (checked by ``all_gather_json``)."""


class TrainerBatchShare:
    """One strategy's batch share: the sizes (resolved once per strategy) and the rebuilt train loaders.

    Args:
        owner: The strategy's class name, for messages.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.sizes: list[int] | None = None
        """Every rank's micro-batch, once resolved."""
        self.throughputs: list[float] | None = None
        """Every rank's measured samples per second (``"auto"`` only)."""

    @staticmethod
    def applies(strategy: Any) -> bool:
        """Whether the loader being processed is the fit loop's train loader."""
        module = strategy.lightning_module
        trainer = None if module is None else module._trainer
        return trainer is not None and bool(trainer.training)

    def train_loader(self, strategy: Any, dataloader: object, setting: Any, *, group_size: int = 1) -> DataLoader:
        """``dataloader`` rebuilt around this rank's :class:`ShareBatchSampler` (sizes resolved on first use).

        Args:
            strategy: The Trainer strategy (collective under ``"auto"``: every rank calls this).
            dataloader: The train loader as Lightning prepared it (a ``DistributedSampler`` may be in it already).
            setting: ``settings.batch_share``: ``"auto"`` or a list of shares.
            group_size: Consecutive ranks that get one size (the ranks of one FlexDeMo model copy).

        Raises:
            ValueError: A loader the share cannot rebuild (an iterable dataset, a custom batch sampler or sampler,
                a ``DataLoader`` subclass other than ``StatefulDataLoader``), shares that fit neither the ranks nor
                the nodes, or a batch too small for one sample per rank.
        """
        loader = self._check_loader(dataloader)
        if self.sizes is None:
            self.sizes = self._resolve(strategy, loader, setting, group_size)
        shuffle, seed = _order_of(loader, self.owner)
        sampler = ShareBatchSampler(
            len(loader.dataset),
            self.sizes,
            strategy.global_rank,
            seed=seed,
            shuffle=shuffle,
            drop_last=loader.drop_last,
        )
        return _rebuild(loader, sampler)

    # ------------------------------------------------------------------------------------------------ resolve
    def _resolve(self, strategy: Any, loader: DataLoader, setting: Any, group_size: int) -> list[int]:
        batch_size, world = int(loader.batch_size), int(strategy.world_size)
        num_nodes = max(int(getattr(strategy, "num_nodes", 1)), 1)
        per_node = world // num_nodes if world % num_nodes == 0 else world
        nodes = [rank // per_node for rank in range(world)]
        if setting == AUTO:
            throughput = batch_size / _probe_seconds(strategy, loader, batch_size, self.owner)
            payload = {"node": int(strategy.node_rank), "throughput": float(throughput)}
            gathered = all_gather_json(payload, world, strategy.root_device, schema=_MEASUREMENT)
            self.throughputs = [float(entry["throughput"]) for entry in gathered]
            nodes = [int(entry["node"]) for entry in gathered]
            rates = self.throughputs
        else:
            try:
                rates = expand_shares(setting, world, num_nodes)
            except ValueError as error:
                raise ValueError(f"{self.owner}: settings.{error}") from None
        try:
            sizes = plan_micro_batches(rates, batch_size, group_size=group_size)
        except ValueError as error:
            raise ValueError(
                f"{self.owner}: settings.batch_share={setting!r} with batch_size={batch_size} on {world} ranks: {error}"
            ) from None
        _log(self.owner, sizes, nodes, self.throughputs)
        return sizes

    def _check_loader(self, dataloader: object) -> DataLoader:
        fix = (
            "use a torch DataLoader or lightning_hetero.data.StatefulDataLoader with a batch_size, or batch_share=None"
        )
        if not isinstance(dataloader, DataLoader):
            raise ValueError(
                f"{self.owner}: settings.batch_share needs a DataLoader train loader, got "
                f"{type(dataloader).__name__}; {fix}."
            )
        if isinstance(dataloader.dataset, IterableDataset) or not isinstance(dataloader.dataset, Sized):
            raise ValueError(
                f"{self.owner}: settings.batch_share cuts a map-style dataset by index; the train "
                f"dataset is a {type(dataloader.dataset).__name__}. Use a map-style dataset or {fix}."
            )
        if dataloader.batch_size is None:
            raise ValueError(
                f"{self.owner}: settings.batch_share replaces the train loader's batch sampler, but it "
                f"has a custom one ({type(dataloader.batch_sampler).__name__}); {fix}."
            )
        if type(dataloader) is not DataLoader and not isinstance(dataloader, StatefulDataLoader):
            raise ValueError(
                f"{self.owner}: settings.batch_share rebuilds the train loader, which it cannot do for a "
                f"{type(dataloader).__name__}; {fix}."
            )
        return dataloader


# ---------------------------------------------------------------------------------------------------- helpers
def _order_of(loader: DataLoader, owner: str) -> tuple[bool, int]:
    """(shuffle, seed) of the loader's sampler, so that the shared order follows what the user asked for."""
    sampler = loader.sampler
    default_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    if isinstance(sampler, DistributedSamplerWrapper):
        raise ValueError(
            f"{owner}: settings.batch_share draws one shared order per epoch; the train loader has a custom sampler "
            f"({type(sampler.dataset).__name__}). Use shuffle=True/False instead, or batch_share=None."
        )
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle), int(sampler.seed)
    if isinstance(sampler, RandomSampler):
        seed = getattr(sampler, "seed", getattr(loader, "seed", default_seed))
        return True, int(seed)
    if isinstance(sampler, SequentialSampler):
        return False, default_seed
    raise ValueError(
        f"{owner}: settings.batch_share draws one shared order per epoch; the train loader has a custom sampler "
        f"({type(sampler).__name__}). Use shuffle=True/False instead, or batch_share=None."
    )


def _rebuild(loader: DataLoader, sampler: ShareBatchSampler) -> DataLoader:
    """The same loader (workers, collate, pinning, ...) with ``sampler`` as its batch sampler."""
    options: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if isinstance(loader, StatefulDataLoader):
        return StatefulDataLoader(loader.dataset, batch_sampler=sampler, seed=loader.seed, **options)
    return DataLoader(loader.dataset, batch_sampler=sampler, **options)


def _probe_seconds(strategy: Any, loader: DataLoader, batch_size: int, owner: str) -> float:
    """Median seconds of one forward and backward pass of ``training_step`` on ``batch_size`` samples.

    Gradients, buffers (e.g. BatchNorm statistics), random state and module modes are restored afterwards, no
    gradient is exchanged (the passes run in the strategy's no-sync scope) and ``self.log`` is muted.
    """
    module = strategy.lightning_module
    if not module.automatic_optimization:
        raise ValueError(
            f"{owner}: settings.batch_share='auto' times training_step, which under manual optimization steps the "
            "optimizer itself; give explicit shares (batch_share: [0.75, 0.25]) instead."
        )
    dataset = loader.dataset
    count = min(batch_size, len(dataset))
    batch = strategy.batch_to_device(loader.collate_fn([dataset[index] for index in range(count)]))
    modes = {sub: sub.training for sub in module.modules()}
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}

    def step() -> None:
        output = strategy.training_step(batch, 0)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            raise ValueError(
                f"{owner}: settings.batch_share='auto' needs training_step to return the loss (a tensor, or a dict "
                "with 'loss') to time its backward; give explicit shares instead."
            )
        loss.backward()
        module.zero_grad(set_to_none=True)

    module.zero_grad(set_to_none=True)
    module.train()
    try:
        with isolate_rng(), _muted(module), strategy.block_backward_sync():
            return time_call(step, strategy.root_device, repeats=PROBE_REPEATS, warmup=PROBE_WARMUP)
    finally:
        for sub, training in modes.items():
            sub.training = training
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])


@contextmanager
def _muted(module: nn.Module) -> Generator[None, None, None]:
    """``self.log`` / ``self.log_dict`` do nothing inside (the probe is no training step to record)."""

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    module.log = ignore  # type: ignore[method-assign]
    module.log_dict = ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log
        del module.log_dict


def _log(owner: str, sizes: Sequence[int], nodes: Sequence[int], throughputs: Sequence[float] | None) -> None:
    total = sum(sizes)
    for rank, size in enumerate(sizes):
        measured = "" if throughputs is None else f", {throughputs[rank]:.1f} samples/s"
        rank_zero_info(
            f"{owner}: batch share rank {rank} (node {nodes[rank]}){measured}: micro-batch {size} of {total} "
            f"({size / total:.1%})"
        )
