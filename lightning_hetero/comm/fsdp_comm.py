"""Count FSDP2's (``fully_shard``) all-gathers and reduce-scatters in the byte ledger, measured per call.

FSDP2 does not go through :mod:`lightning_hetero.comm.collectives`, but it lets a module replace its collectives
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``). :func:`count_fsdp2` installs
:class:`~lightning_hetero.comm.collectives.CountedFSDPAllGather` and
:class:`~lightning_hetero.comm.collectives.CountedFSDPReduceScatter`: the same ``torch.distributed`` calls FSDP makes
by default, each recorded with the bytes of the flat tensors FSDP hands them (forward and backward all-gathers,
gradient reduce-scatters, padding included).

What stays uncounted (see :func:`count_fsdp2`'s return value): modules whose comms someone else replaced (FSDP
allows one), modules FSDP refuses custom comms for (several parameter groups), and HSDP's all-reduce across the
replicate dimension of a 2-D mesh (FSDP calls ``torch.distributed.all_reduce`` itself there).

Nothing here imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_hetero.comm.collectives import CountedFSDPAllGather, CountedFSDPReduceScatter
from lightning_hetero.comm.ledger import ByteLedger, validate_label

__all__ = ["FSDP2Coverage", "count_fsdp2"]

_DEFAULT_COMMS = ("DefaultAllGather", "DefaultReduceScatter")  # FSDP's own: safe to replace
_OURS = (CountedFSDPAllGather, CountedFSDPReduceScatter)


@dataclass
class FSDP2Coverage:
    """Which ``fully_shard`` modules of a model are counted."""

    counted: list[str] = field(default_factory=list)
    """Qualified names of modules whose all-gather and reduce-scatter are counted."""
    uncounted: dict[str, str] = field(default_factory=dict)
    """Module name -> why its collectives are not counted."""
    hsdp: list[str] = field(default_factory=list)
    """Modules on a 2-D mesh (HSDP or FSDP + TP): FSDP's replicate all-reduce and other dims are not counted."""


def _current_comms(module: FSDPModule) -> list[object] | None:
    """The comm objects FSDP will call for ``module``, or None when this torch version does not tell."""
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
        return [comm for group in groups for comm in (group._all_gather_comm, group._reduce_scatter_comm)]
    except AttributeError:
        return None


def count_fsdp2(model: nn.Module, label: str, ledger: ByteLedger | None = None) -> FSDP2Coverage:
    """Count every ``fully_shard`` module of ``model`` whose collectives are FSDP's defaults (idempotent).

    Args:
        model: A model with ``fully_shard`` applied (already set up; before its first forward is best).
        label: Ledger label for the shard group's traffic (e.g. ``"intra"`` for a node-local shard group).
        ledger: Ledger to record into (default: the process-global one).

    Returns:
        What is counted and what is not, per module.
    """
    validate_label(label)
    coverage = FSDP2Coverage()
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        name = name or "<root>"
        if any(getattr(p, "device_mesh", None) is not None and p.device_mesh.ndim > 1 for p in module.parameters()):
            coverage.hsdp.append(name)
        comms = _current_comms(module)
        if comms is None:
            coverage.uncounted[name] = "this torch version does not expose FSDP2's comm objects"
            continue
        if not comms or all(isinstance(c, _OURS) for c in comms):
            coverage.counted.append(name)  # nothing to count (no parameters of its own) or counted already
            continue
        ours = (CountedFSDPAllGather, CountedFSDPReduceScatter)
        foreign = [
            type(c).__name__ for c in comms if not isinstance(c, ours) and type(c).__name__ not in _DEFAULT_COMMS
        ]
        if foreign:
            coverage.uncounted[name] = f"custom FSDP comms already installed ({', '.join(foreign)})"
            continue
        try:
            module.set_custom_all_gather(CountedFSDPAllGather(label, ledger))
            module.set_custom_reduce_scatter(CountedFSDPReduceScatter(label, ledger))
        except ValueError as error:  # e.g. several parameter groups (per-parameter meshes)
            coverage.uncounted[name] = str(error)
            continue
        coverage.counted.append(name)
    return coverage
