"""FSDP2 inside a model copy: find the transformer blocks, shard each and the root on the ``"shard"`` mesh.

Sharding on the 1-D ``"shard"`` sub-mesh (not the 2-D mesh) is what makes FlexDeMo possible with FSDP2: gradients are
reduce-scattered inside the copy during backward and land in ``.grad`` as ``Shard(0)`` DTensors, and nothing is
reduced across copies (HSDP with ``set_requires_all_reduce(False)`` would leave ``.grad`` None). Each copy is then its
own FSDP world, so :func:`broadcast_initial_state` copies the first replica's shards and buffers to the others.

Blocks are found from the model, in this order:

1. ``block_classes`` given by the user (class names);
2. the ``_no_split_modules`` class names of every Hugging Face model in the tree (Llama, GPT-2, T5, ViT, ...);
3. the children of ``nn.ModuleList`` s whose children all share one class (BERT, plain PyTorch stacks);
4. none: the root alone is sharded (one all-gather of the whole copy per forward), with a warning.

Nothing here imports Lightning.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_hetero import comm
from lightning_hetero.core.state import broadcast_module_state
from lightning_hetero.flexdemo.topology import Topology

__all__ = [
    "ShardingUnit",
    "apply_activation_checkpointing",
    "broadcast_initial_state",
    "find_blocks",
    "local_tensor",
    "shard_model",
    "sharding_units",
    "warn_no_blocks",
]


@dataclass
class ShardingUnit:
    """One FSDP2 unit (a block, or the root's remaining parameters): its parameters are reduced together."""

    name: str
    """Module path (``""`` for the root)."""
    params: list[nn.Parameter] = field(default_factory=list)
    """Trainable parameters owned by this unit (not by a nested block), in ``named_parameters`` order."""


def local_tensor(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def find_blocks(
    module: nn.Module, block_classes: Sequence[str] | None = None
) -> tuple[list[tuple[str, nn.Module]], str]:
    """The outermost transformer blocks of ``module`` (path, block) in module order, and how they were found.

    Args:
        module: The module tree to search (a LightningModule, an HF model, any ``nn.Module``).
        block_classes: Class names to use instead of the automatic search.

    Returns:
        ``(blocks, source)`` with ``source`` one of ``"block_classes"``, ``"_no_split_modules"``, ``"ModuleList"``,
        ``"none"``.

    Raises:
        ValueError: ``block_classes`` names no class found in ``module``.
    """
    if block_classes:
        names = set(block_classes)
        blocks = _outermost(module, lambda sub: type(sub).__name__ in names)
        if not blocks:
            present = sorted({type(sub).__name__ for sub in module.modules()})
            raise ValueError(
                f"block_classes={sorted(names)} matches no module of {type(module).__name__}. Class names present: "
                f"{present[:40]}"
            )
        return blocks, "block_classes"
    no_split: set[str] = set()
    for sub in module.modules():
        no_split.update(getattr(sub, "_no_split_modules", None) or [])
    if no_split:
        blocks = _outermost(module, lambda sub: type(sub).__name__ in no_split)
        if blocks:
            return blocks, "_no_split_modules"
    stacked: set[int] = set()
    for sub in module.modules():
        children = list(sub.children()) if isinstance(sub, nn.ModuleList) else []
        if len(children) >= 2 and len({type(c) for c in children}) == 1 and any(True for _ in sub.parameters()):
            stacked.update(id(c) for c in children)
    blocks = _outermost(module, lambda sub: id(sub) in stacked)
    return blocks, ("ModuleList" if blocks else "none")


def _outermost(module: nn.Module, match: object) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for path, sub in module.named_modules():
        if sub is module or not match(sub):  # type: ignore[operator]
            continue
        if any(path.startswith(prefix + ".") for prefix, _ in found):
            continue  # nested inside a block already found
        found.append((path, sub))
    return found


def apply_activation_checkpointing(blocks: Iterable[nn.Module]) -> None:
    """Recompute each block's activations in backward (composable, in place: names and state dicts are unchanged)."""
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)


def shard_model(
    module: nn.Module,
    topology: Topology,
    blocks: Sequence[nn.Module],
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> bool:
    """``fully_shard`` every block, then the root, on the ``"shard"`` mesh; returns whether anything was sharded.

    Nothing is sharded with a shard size of 1 (each rank holds its whole copy; plain tensors, DDP-like) or in a
    single process. ``param_dtype`` (e.g. bf16 under ``bf16-mixed``) is the compute dtype of the gathered
    parameters; gradients are reduced and stored in fp32 (the sharded parameters' dtype).
    """
    mesh = topology.shard_mesh
    if mesh is None or topology.shard_size == 1:
        return False
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return True


def sharding_units(module: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> list[ShardingUnit]:
    """The trainable parameters of every block and of the root remainder, in backward order (last block first).

    FSDP2 reduce-scatters units in roughly this order during backward, and the root's unit last; the overlap hooks
    launch the inter-node exchange in exactly this order on every replica.
    """
    seen: set[int] = set()
    units: list[ShardingUnit] = []
    for path, block in blocks:
        unit = ShardingUnit(path)
        for param in block.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                unit.params.append(param)
        units.append(unit)
    root = ShardingUnit("")
    for param in module.parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            root.params.append(param)
    return [unit for unit in [*reversed(units), root] if unit.params]


@torch.no_grad()
def broadcast_initial_state(module: nn.Module, topology: Topology) -> int:
    """Copy the first replica's parameter shards and buffers to every replica (collective over the replicate group).

    Each copy is its own FSDP world and nothing else keeps copies equal at the start. Returns the number of tensors
    broadcast (0 when there is a single replica).
    """
    if topology.replicate_group is None:
        return 0
    # The source is the global rank of this shard position in the first replica.
    return broadcast_module_state(module, topology.shard_index, group=topology.replicate_group, label=comm.INTER)


def warn_no_blocks(owner: str, module: nn.Module) -> None:
    """The root-only fallback warning."""
    warnings.warn(
        f"{owner}: no transformer blocks found in {type(module).__name__} (no HF `_no_split_modules`, no ModuleList "
        "of identical layers), so the whole model copy is one FSDP2 unit: every forward all-gathers it at once and "
        "nothing overlaps. Pass block_classes=['MyBlock'] to shard per block.",
        UserWarning,
        stacklevel=3,
    )
