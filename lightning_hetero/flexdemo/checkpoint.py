"""FlexDeMo's sharded checkpoint: a directory with one file per rank plus a metadata file.

Layout of ``<path>/`` (``path`` is what the Trainer/Fabric was asked to save to, e.g. ``epoch=0-step=3.ckpt``)::

    meta.pt            rank 0: format, version, world size, shard size, replicas, global parameter shapes
    rank_00000.pt      rank 0's whole checkpoint: model state with *local* shards, optimizer state (momentum, error
    rank_00001.pt      feedback, Adam moments, the replicator's step/RNG/stride/DiLoCo state), loops, schedulers, ...

Every file is a plain ``torch.save`` of tensors that are not DTensors, so loading needs no process group and no
DCP. Replicas hold identical copies, so the files of replica ``r > 0`` duplicate replica 0's parameters; they are
kept because per-rank optimizer state (error feedback) differs between replicas. A run with the same world size and
shard size loads its own rank's file; a run with another layout (more or fewer nodes or ranks per node, another
shard size) rebuilds its part from all of them (:mod:`lightning_hetero.flexdemo.reshard`, which states the rule
for a changed replica count).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hetero import comm
from lightning_hetero.core.checkpoint_dir import load_part, write_part
from lightning_hetero.flexdemo.reshard import SavedLayout, TargetLayout, load_resharded_part
from lightning_hetero.flexdemo.topology import Topology

__all__ = [
    "FORMAT",
    "META_FILE",
    "full_state_dict",
    "is_sharded_checkpoint",
    "load_local_module_state",
    "load_rank_part",
    "local_module_state",
    "rank_file",
    "read_meta",
    "write_meta",
]

FORMAT = "flexdemo-sharded"
VERSION = 1
META_PART = "meta"
META_FILE = f"{META_PART}.pt"


def rank_file(path: str | Path, rank: int) -> Path:
    """The file of ``rank`` inside a sharded checkpoint directory."""
    return Path(path) / f"rank_{rank:05d}.pt"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a FlexDeMo sharded checkpoint directory."""
    return (Path(path) / META_FILE).is_file()


def make_meta(module: nn.Module, topology: Topology) -> dict[str, Any]:
    """Metadata written by rank 0 next to the rank files."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": topology.world_size,
        "shard_size": topology.shard_size,
        "num_replicas": topology.num_replicas,
        "shapes": {name: list(t.shape) for name, t in module.state_dict().items() if isinstance(t, Tensor)},
    }


def write_meta(path: str | Path, module: nn.Module, topology: Topology) -> None:
    """Write ``meta.pt`` (rank 0) like a part: atomically, with its SHA-256 next to it."""
    write_part(path, META_PART, make_meta(module, topology))


def read_meta(path: str | Path, topology: Topology, owner: str) -> dict[str, Any]:
    """Read and check ``meta.pt`` (any saved layout is accepted: another one is re-cut on load).

    Raises:
        ValueError: not a FlexDeMo checkpoint, another format version, or fields that cannot be (a shard size not
            dividing the world size, sizes that are not integers, no valid ``shapes``).
    """
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise ValueError(f"{owner}: {path} is not a FlexDeMo sharded checkpoint (no {META_FILE}).")
    meta = load_part(path, META_PART)  # weights_only (safe_load), checked against its checksum when it has one
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{owner}: {meta_path} has format {found!r}, expected {FORMAT!r}.")
    if not _is_int(meta.get("version")) or meta["version"] != VERSION:
        raise ValueError(
            f"{owner}: {meta_path} has version {meta.get('version')!r}; this lightning-hetero reads version {VERSION} "
            "(written by another release?)."
        )
    world_size, shard_size = meta.get("world_size"), meta.get("shard_size")
    if (
        not _is_int(world_size)
        or not _is_int(shard_size)
        or world_size < 1
        or shard_size < 1
        or world_size % shard_size
    ):
        raise ValueError(f"{owner}: {meta_path} records world_size={world_size!r}, shard_size={shard_size!r}: damaged.")
    shapes = meta.get("shapes")
    if not isinstance(shapes, dict) or not all(
        isinstance(name, str) and isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)
        for name, shape in shapes.items()
    ):
        raise ValueError(f"{owner}: {meta_path} has no valid 'shapes' (name -> list of sizes >= 0): damaged.")
    return meta


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_rank_part(
    path: str | Path,
    topology: Topology,
    module: nn.Module | None,
    params: list[Tensor],
    owner: str,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """This rank's part of the checkpoint at ``path``: its own file, or one re-cut from a run with another layout.

    Args:
        path: The checkpoint directory.
        topology: This run's layout.
        module: The live sharded module (needed only when the layout changed).
        params: The live optimizer's parameters in ``param_groups`` order (empty without an optimizer).
        owner: Strategy name for messages.
        map_location: Where the tensors of an unchanged layout's own part go (a re-cut part is on the CPU).

    Raises:
        ValueError: not a FlexDeMo checkpoint; or the layout changed and the model differs from the saved one
            (the message names the entry), or no module is set up yet.
    """
    meta = read_meta(path, topology, owner)
    saved = SavedLayout(int(meta["world_size"]), int(meta["shard_size"]))
    if (saved.world_size, saved.shard_size) == (topology.world_size, topology.shard_size):
        return load_part(path, rank_file(".", topology.rank).stem, map_location=map_location)
    if module is None:
        raise ValueError(f"{owner}: re-cutting the checkpoint {path} for a new layout needs the model set up first.")
    shapes = {name: list(value.shape) for name, value in module.state_dict().items() if isinstance(value, Tensor)}
    if shapes != meta["shapes"]:
        different = sorted(n for n in set(shapes) | set(meta["shapes"]) if shapes.get(n) != meta["shapes"].get(n))
        raise ValueError(
            f"{owner}: the checkpoint {path} holds another model (entries that differ: {different[:8]}); resume with "
            "the model that saved it."
        )
    target = TargetLayout(topology.num_replicas, topology.replica_index, topology.shard_size, topology.shard_index)
    names = [rank_file(".", rank).stem for rank in range(saved.world_size)]
    return load_resharded_part(path, names, saved, target, meta["shapes"], module, params)


def local_module_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every DTensor replaced by a detached copy of its local shard."""
    return {
        name: (value.to_local().detach().clone() if isinstance(value, DTensor) else value)
        for name, value in module.state_dict().items()
    }


@torch.no_grad()
def load_local_module_state(module: nn.Module, state: Mapping[str, Any], strict: bool = True, owner: str = "") -> None:
    """Copy a :func:`local_module_state` into ``module`` in place (shards into the local shards).

    Raises:
        KeyError: ``strict`` and the keys differ.
        ValueError: a local shard's shape differs (another layout or model).
    """
    current = module.state_dict()
    missing = sorted(set(current) - set(state))
    unexpected = sorted(set(state) - set(current))
    if strict and (missing or unexpected):
        raise KeyError(
            f"{owner}: checkpoint keys differ from the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, target in current.items():
        if name not in state:
            continue
        local = target.to_local() if isinstance(target, DTensor) else target
        value = state[name]
        value = value.to_local() if isinstance(value, DTensor) else value
        if local.shape != value.shape:
            raise ValueError(
                f"{owner}: {name} has local shape {tuple(value.shape)} in the checkpoint but {tuple(local.shape)} here "
                "(another model or shard layout)."
            )
        local.copy_(value)


@torch.no_grad()
def full_state_dict(module: nn.Module, topology: Topology, label: str = comm.INTRA) -> dict[str, Tensor]:
    """The unsharded state dict (CPU tensors) on every rank: collective over each shard group.

    Each Shard(0) DTensor is padded to ``ceil(rows / shard_size)`` rows, all-gathered inside the model copy and cut
    back; plain tensors are copied.
    """
    out: dict[str, Tensor] = {}
    for name, value in module.state_dict().items():
        if not isinstance(value, Tensor):
            continue
        if not isinstance(value, DTensor) or topology.shard_group is None:
            out[name] = (value.to_local() if isinstance(value, DTensor) else value).detach().cpu().clone()
            continue
        local, rows = value.to_local(), value.shape[0]
        chunk = -(-rows // topology.shard_size)
        padded = torch.zeros((chunk, *local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        gathered = torch.empty((chunk * topology.shard_size, *local.shape[1:]), dtype=local.dtype, device=local.device)
        comm.all_gather_into_tensor(gathered, padded, group=topology.shard_group, label=label)
        out[name] = gathered[:rows].cpu().clone()
    return out
