"""The FlexDeMo process layout: a ``("replicate", "shard")`` DeviceMesh of shape ``(replicas, shard_size)``.

Consecutive global ranks shard one model copy together (FSDP2 inside a node); ranks at the same position of every
copy form a replicate group (the compressed inter-node exchange). With ``shard_size`` ranks per copy::

    rank = replica * shard_size + shard_position

so the shard group of rank ``r`` is ``[r - r % S, ..., r - r % S + S - 1]`` and its replicate group is
``[r % S, r % S + S, ...]``. Nothing here imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MESH_DIMS", "Topology", "build_topology", "resolve_shard_size"]

MESH_DIMS = ("replicate", "shard")
"""Dimension names of the FlexDeMo DeviceMesh."""


@dataclass(frozen=True)
class Topology:
    """Where this rank sits in the ``(replicas, shard_size)`` layout, and the process groups of both dimensions.

    ``mesh`` and the groups are None in a single-process run; ``replicate_group`` is also None with one replica and
    ``shard_group`` with a shard size of 1 (nothing to exchange on that dimension).
    """

    world_size: int
    rank: int
    shard_size: int
    mesh: DeviceMesh | None = None
    replicate_group: Any | None = None
    shard_group: Any | None = None

    @property
    def num_replicas(self) -> int:
        """Number of model copies (nodes, by default)."""
        return self.world_size // self.shard_size

    @property
    def replica_index(self) -> int:
        """Which model copy this rank belongs to (0 is the first replica)."""
        return self.rank // self.shard_size

    @property
    def shard_index(self) -> int:
        """This rank's position inside its copy (its FSDP2 shard)."""
        return self.rank % self.shard_size

    @property
    def replicate_ranks(self) -> list[int]:
        """Global ranks of this rank's replicate group, first replica first."""
        return [replica * self.shard_size + self.shard_index for replica in range(self.num_replicas)]

    @property
    def shard_ranks(self) -> list[int]:
        """Global ranks that shard this rank's model copy."""
        start = self.replica_index * self.shard_size
        return list(range(start, start + self.shard_size))

    @property
    def shard_mesh(self) -> DeviceMesh | None:
        """The 1-D ``"shard"`` sub-mesh that FSDP2 shards over (None in a single-process run)."""
        return None if self.mesh is None else self.mesh["shard"]


def resolve_shard_size(shard_size: int | None, world_size: int, ranks_per_node: int, owner: str) -> int:
    """The number of ranks that shard one copy: ``shard_size``, or every rank of a node when None.

    ``shard_size`` was checked to be a positive int (or None) by ``FlexDeMoSettings``.

    Raises:
        ValueError: ``shard_size`` does not divide the ranks of a node (a model copy must not span nodes: its
            reduce-scatter would then cross the slow link).
    """
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"{owner}: {world_size} ranks cannot be split into nodes of {ranks_per_node} ranks.")
    if shard_size is None:
        return ranks_per_node
    if ranks_per_node % shard_size:
        divisors = [d for d in range(1, ranks_per_node + 1) if ranks_per_node % d == 0]
        raise ValueError(
            f"{owner}: settings.shard_size={shard_size} must divide the {ranks_per_node} ranks per node, so that a "
            f"model copy never spans two nodes. Valid values: {divisors} (or None for {ranks_per_node})."
        )
    return shard_size


def build_topology(device: torch.device, shard_size: int) -> Topology:
    """Build the mesh and groups (collective: every rank calls it); a trivial layout when running alone.

    Args:
        device: This rank's device; its type names the mesh's device type.
        shard_size: Ranks per model copy; must divide the world size.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Topology(world_size=1, rank=0, shard_size=1)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % shard_size:
        raise ValueError(f"shard_size={shard_size} does not divide the world size {world_size}.")
    mesh = init_device_mesh(device.type, (world_size // shard_size, shard_size), mesh_dim_names=MESH_DIMS)
    replicate_group = mesh["replicate"].get_group() if world_size > shard_size else None
    shard_group = mesh["shard"].get_group() if shard_size > 1 else None
    return Topology(world_size, rank, shard_size, mesh, replicate_group, shard_group)
