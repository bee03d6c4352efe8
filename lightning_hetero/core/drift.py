"""Replica drift guard: a bitwise checksum of every parameter shard, compared across the replicate group.

Replicas must stay bit-identical (every replicator decodes deterministically in a fixed rank order). A silent
divergence (a nondeterministic kernel, a rank that skipped a step, a bad checkpoint load) would otherwise train
several different models that merely share gradients. :func:`check_replica_drift` hashes the raw bits of each local
shard into two int64 words, all-gathers them over the replicate group (ledger label ``"drift"``, 16 bytes per
parameter), and then shares a two-int verdict over the world so that every rank raises the same error.

The layout it assumes is the one every strategy here uses: ``rank = replica * shard_size + shard_position``, the
replicate group of a rank holding the ranks at its shard position of every replica (``shard_size=1`` when every rank
holds a whole copy, as in SparseFlip). Nothing here imports Lightning or a method package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_hetero import comm

__all__ = ["DRIFT_LABEL", "ReplicaDriftError", "check_replica_drift", "tensor_checksum"]

DRIFT_LABEL = "drift"
"""Ledger label of the drift guard's collectives (kept apart from the replicators' ``"inter"`` payload)."""


class ReplicaDriftError(RuntimeError):
    """Replicas of the model no longer hold bit-identical parameters."""


@torch.no_grad()
def tensor_checksum(tensor: Tensor) -> Tensor:
    """Two int64 words that change when any bit of ``tensor`` changes (sum and position-weighted sum of its words)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=tensor.device)
    raw = flat.view(torch.uint8)
    if raw.numel() % 4 == 0:
        words = raw.view(torch.int32).to(torch.int64)
    elif raw.numel() % 2 == 0:
        words = raw.view(torch.int16).to(torch.int64)
    else:
        words = raw.to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([words.sum(), (words * weights).sum()])  # int64 overflow wraps identically everywhere


@torch.no_grad()
def check_replica_drift(
    named_params: Sequence[tuple[str, Tensor]],
    step: int,
    *,
    owner: str,
    num_replicas: int,
    replicate_group: Any | None = None,
    shard_size: int = 1,
) -> None:
    """Raise :class:`ReplicaDriftError` on every rank if any replica's shard differs from the first replica's.

    Collective over the whole world (every rank must call it at the same step). Nothing happens with one replica.

    Args:
        named_params: This rank's ``(name, tensor)`` pairs, the same names in the same order on every rank; a DTensor
            is compared by its local shard.
        step: The optimizer step, for the message.
        owner: Who runs the guard (``"FlexDeMo"``, ``"SparseFlip"``); the message starts with it.
        num_replicas: Model copies in the world (``world_size // shard_size``).
        replicate_group: The process group of this rank's replicas (None: the default group, for ``shard_size=1``).
        shard_size: Ranks that shard one copy (consecutive global ranks).

    Raises:
        ReplicaDriftError: naming the step, the first differing parameter and the ranks that disagree.
    """
    if num_replicas <= 1 or not named_params:
        return
    device = next(p.device for _, p in named_params)
    sums = torch.stack([tensor_checksum(p.to_local() if isinstance(p, DTensor) else p) for _, p in named_params])
    gathered = torch.empty((num_replicas * sums.shape[0], 2), dtype=sums.dtype, device=sums.device)
    comm.all_gather_into_tensor(gathered, sums, group=replicate_group, label=DRIFT_LABEL)
    gathered = gathered.view(num_replicas, *sums.shape)
    differs = (gathered != gathered[:1]).any(dim=-1)  # (replicas, params)
    bad_params = differs.any(dim=0).nonzero().flatten()
    first_bad = int(bad_params[0]) if bad_params.numel() else len(named_params)
    # One flag per replica (not a bitmask: an int64 mask overflows at 64 replicas), so every rank can name them all.
    replica_flags = differs[:, first_bad] if bad_params.numel() else torch.zeros_like(differs[:, 0])
    verdict = torch.cat([torch.tensor([first_bad], device=device), replica_flags.to(device=device)]).to(torch.int64)
    world_size = dist.get_world_size()
    verdicts = torch.empty(world_size * (1 + num_replicas), dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(verdicts, verdict, label=DRIFT_LABEL)
    verdicts = verdicts.view(world_size, 1 + num_replicas).cpu()
    failing = [(rank, int(v[0]), v[1:]) for rank, v in enumerate(verdicts) if int(v[0]) < len(named_params)]
    if not failing:
        return
    rank, index, flags = min(failing, key=lambda item: (item[1], item[0]))
    shard = rank % shard_size
    reference = shard  # the first replica's rank at this shard position
    disagreeing = [replica * shard_size + shard for replica in range(num_replicas) if bool(flags[replica])]
    raise ReplicaDriftError(
        f"{owner} replica drift at optimizer step {step}: parameter {named_params[index][0]!r} (the first that "
        f"differs) on rank(s) {disagreeing} is not bit-identical to rank {reference} (first replica, shard position "
        f"{shard}); {len(failing)} rank(s) saw a mismatch. Replicas must apply identical updates: check for "
        "nondeterministic kernels, per-rank randomness in the optimizer, or a partial checkpoint load."
    )
