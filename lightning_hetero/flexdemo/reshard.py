"""Resume a FlexDeMo sharded checkpoint on another layout: world size, shard size and replica count may all change.

The saved parts are consolidated and re-cut ("consolidate-and-reshard"): every resuming rank reads the parts of
all saved ranks (checksummed, ``weights_only``), reassembles each replica's full tensors from its shards, picks or
combines the replicas, and cuts its own FSDP2 shard out of the result. What it returns looks exactly like the part
it would have saved itself, so the Trainer and Fabric restore it the usual way.

Which tensors are re-cut:

- the model state (every entry of the module's ``state_dict``; full shapes from ``meta.pt``);
- every optimizer state tensor shaped like its parameter (DeMo momentum ``delta``, AdamW ``exp_avg`` /
  ``exp_avg_sq``, error feedback ``error``), matched to parameters by position as ``Optimizer.load_state_dict``
  does;
- the replicator's per-parameter tensors (DiLoCo ``anchors`` / ``outer_buffers``, DeMo + DiLoCo's error feedback
  ``outer_residuals``, keyed by parameter position).

Everything else (loops, schedulers, counters, the optimizer's scalar ``step``) is taken from saved rank 0.

The replica rule: with the same number of replicas, new replica ``i`` keeps old replica ``i``'s state (only the
shards are re-cut). With another number, every new replica starts from the element-wise mean over the old replicas
(computed in float64; when all old replicas hold identical values, those values are taken bit for bit). Why the
mean: the combined update of a step is the replica mean of what each replica sends, so the mean of the
error-feedback buffers is the part of the update the replicas still owe the model; every new replica holding that
mean keeps it unchanged, and no old replica's residual is counted twice or dropped. Replicated state (parameters,
full-sync moments, DiLoCo anchors) is identical on every replica, so the rule leaves it exact.

Cost: each resuming rank reads every saved part (the whole checkpoint) into CPU memory once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hetero.core.checkpoint_dir import load_part

__all__ = ["SavedLayout", "combine_replicas", "consolidate_pieces", "cut_shard", "load_resharded_part"]


@dataclass(frozen=True)
class SavedLayout:
    """The ``(replicas, shard_size)`` layout a checkpoint was written with (rank = replica * shard_size + shard)."""

    world_size: int
    shard_size: int

    @property
    def num_replicas(self) -> int:
        """Model copies in the saved run."""
        return self.world_size // self.shard_size

    def ranks_of(self, replica: int) -> list[int]:
        """Saved global ranks that held the shards of ``replica``."""
        return list(range(replica * self.shard_size, (replica + 1) * self.shard_size))


@dataclass(frozen=True)
class TargetLayout:
    """Where the resuming rank sits: its replica, its shard position and the counts of both."""

    num_replicas: int
    replica: int
    shard_size: int
    shard_index: int


def consolidate_pieces(pieces: Sequence[Tensor], full_shape: Sequence[int], name: str) -> Tensor:
    """One replica's full tensor from its shard pieces (in shard order).

    Pieces that all have the full shape are copies (an unsharded tensor, or shard size 1): the first is taken.
    Otherwise they are row shards (FSDP2's ``Shard(0)``) and are concatenated.

    Raises:
        ValueError: the pieces assemble to another shape (another model or a damaged checkpoint); names the entry.
    """
    full = tuple(full_shape)
    if all(tuple(piece.shape) == full for piece in pieces):
        return pieces[0]
    joined = torch.cat(list(pieces), dim=0)
    if tuple(joined.shape) != full:
        raise ValueError(
            f"{name}: the saved shards {[tuple(p.shape) for p in pieces]} assemble to {tuple(joined.shape)}, not the "
            f"full shape {full} (the checkpoint belongs to another model or is damaged)."
        )
    return joined


def combine_replicas(fulls: Sequence[Tensor], target: TargetLayout) -> Tensor:
    """The full tensor new replica ``target.replica`` starts from (the replica rule of the module docstring)."""
    if len(fulls) == target.num_replicas:
        return fulls[target.replica]
    first = fulls[0]
    if not first.is_floating_point() or all(torch.equal(first, other) for other in fulls[1:]):
        return first
    return torch.stack([full.double() for full in fulls]).mean(dim=0).to(first.dtype)


def cut_shard(full: Tensor, like: Tensor, sharded: bool, target: TargetLayout, name: str) -> Tensor:
    """This rank's piece of ``full``: FSDP2's ``Shard(0)`` rows (``ceil(rows / shard_size)`` per rank) or all of it.

    Raises:
        ValueError: the piece does not have the shape of ``like`` (the live local tensor it will be copied into).
    """
    piece = full
    if sharded:
        rows = full.shape[0]
        chunk = -(-rows // target.shard_size)
        start = min(target.shard_index * chunk, rows)
        piece = full[start : start + chunk]
    if piece.shape != like.shape:
        raise ValueError(
            f"{name}: re-cut to {tuple(piece.shape)} for shard {target.shard_index} of {target.shard_size}, but this "
            f"rank holds {tuple(like.shape)} (the model or its sharding differs from the saved run)."
        )
    return piece.clone()


class _Resharder:
    """Builds the resuming rank's part from every saved part (see the module docstring)."""

    def __init__(
        self,
        parts: Sequence[Mapping[str, Any]],
        saved: SavedLayout,
        target: TargetLayout,
        full_shapes: Mapping[str, Sequence[int]],
        module: nn.Module,
        params: Sequence[Tensor],
    ) -> None:
        self.parts, self.saved, self.target = parts, saved, target
        self.full_shapes = full_shapes
        self.module_state = module.state_dict()
        self.params = list(params)

    def tensor(self, pieces_of: Any, full_shape: Sequence[int], like: Tensor, sharded: bool, name: str) -> Tensor:
        """Consolidate each saved replica (``pieces_of(rank)`` is the saved value at rank), combine, cut."""
        fulls = [
            consolidate_pieces([pieces_of(rank) for rank in self.saved.ranks_of(replica)], full_shape, name)
            for replica in range(self.saved.num_replicas)
        ]
        return cut_shard(combine_replicas(fulls, self.target), like, sharded, self.target, name)

    def visit(self, values: Sequence[Any], where: str) -> Any:
        """``values``: the same entry in every saved part (rank order); returns this rank's entry."""
        head = values[0]
        if isinstance(head, Mapping):
            if self._is_module_state(head):
                return self.module_state_part(values, where)
            if "state" in head and "param_groups" in head:
                return self.optimizer_part(values, where)
            return {key: self.visit([_entry(value, key, head) for value in values], f"{where}.{key}") for key in head}
        if isinstance(head, (list, tuple)) and all(len(v) == len(head) for v in values):
            items = [self.visit([value[i] for value in values], f"{where}[{i}]") for i in range(len(head))]
            return type(head)(items) if isinstance(head, list) else tuple(items)
        return head

    def _is_module_state(self, entry: Mapping[str, Any]) -> bool:
        tensors = {key for key, value in entry.items() if isinstance(value, Tensor)}
        return bool(tensors) and tensors == set(self.full_shapes)

    def module_state_part(self, values: Sequence[Mapping[str, Any]], where: str) -> dict[str, Any]:
        out = dict(values[0])
        for name, shape in self.full_shapes.items():
            live = self.module_state.get(name)
            if live is None:
                raise ValueError(f"{where}: the checkpoint holds {name!r}, which this model does not have.")
            sharded = isinstance(live, DTensor)
            like = live.to_local() if sharded else live
            out[name] = self.tensor(lambda rank, n=name: values[rank][n], shape, like, sharded, f"{where}.{name}")
        return out

    def optimizer_part(self, values: Sequence[Mapping[str, Any]], where: str) -> dict[str, Any]:
        head = values[0]
        if not self.params:
            # No live optimizer (validate/test, or a model-only load): nothing will load this state, and nothing
            # tells which parameter each entry belongs to; saved rank 0's is passed through unchanged.
            return dict(head)
        out = {key: self.visit([value[key] for value in values], f"{where}.{key}") for key in head if key != "state"}
        state = {}
        for index, entry in head["state"].items():
            state[index] = {
                key: self.param_like(
                    index, lambda rank, i=index, k=key: values[rank]["state"][i][k], f"{where}[{index}]"
                )
                if isinstance(value, Tensor) and value.dim() > 0
                else value
                for key, value in entry.items()
            }
        out["state"] = state
        replicator = head.get("replicator")
        if isinstance(replicator, Mapping):
            out["replicator"] = self.replicator_part([value["replicator"] for value in values], f"{where}.replicator")
        return out

    def replicator_part(self, values: Sequence[Mapping[str, Any]], where: str) -> dict[str, Any]:
        """Per-parameter tensors (``{position: tensor}`` maps such as DiLoCo's anchors) are re-cut; the rest kept."""
        out = dict(values[0])
        for key, value in values[0].items():
            if isinstance(value, Mapping) and value and all(isinstance(k, int) for k in value):
                out[key] = {
                    index: self.param_like(index, lambda rank, k=key, i=index: values[rank][k][i], f"{where}.{key}")
                    for index in value
                }
        return out

    def param_like(self, index: int, pieces_of: Any, name: str) -> Tensor:
        """A tensor shaped like optimizer parameter ``index``, re-cut like the parameter."""
        if not 0 <= index < len(self.params):
            raise ValueError(f"{name}: parameter #{index} does not exist in this optimizer ({len(self.params)}).")
        param = self.params[index]
        sharded = isinstance(param, DTensor)
        like = param.to_local() if sharded else param
        return self.tensor(pieces_of, tuple(param.shape), like, sharded, name)


def _entry(value: Any, key: Any, head: Mapping[Any, Any]) -> Any:
    """``value[key]``, or rank 0's entry where another rank's part lacks it (only rank 0's is kept there anyway)."""
    return value[key] if isinstance(value, Mapping) and key in value else head[key]


def load_resharded_part(
    directory: str | Path,
    part_names: Sequence[str],
    saved: SavedLayout,
    target: TargetLayout,
    full_shapes: Mapping[str, Sequence[int]],
    module: nn.Module,
    params: Sequence[Tensor],
) -> dict[str, Any]:
    """This rank's checkpoint part, rebuilt from the parts of a run with another layout.

    Args:
        directory: The checkpoint directory.
        part_names: The saved part of every saved global rank, in rank order.
        saved: The saved layout.
        target: This rank's place in the resuming layout.
        full_shapes: Full (unsharded) shape of every model state entry (``meta.pt``'s ``shapes``).
        module: The live, already sharded module (gives each entry's local shape and whether it is sharded).
        params: The live optimizer's parameters in ``param_groups`` order (empty without an optimizer).

    Raises:
        FileNotFoundError, CorruptCheckpointError: a saved part is missing or damaged (from ``load_part``).
        ValueError: the model does not match the checkpoint; names the entry.
    """
    parts = [load_part(directory, name, map_location="cpu") for name in part_names]
    return _Resharder(parts, saved, target, full_shapes, module, params).visit(parts, "checkpoint")
