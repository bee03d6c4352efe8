"""Count stock ``DistributedDataParallel``'s gradient all-reduce in the byte ledger, measured per bucket.

Stock DDP does not go through :mod:`lightning_hetero.comm.collectives`: its reducer all-reduces gradient buckets
itself. :func:`register_counted_allreduce` registers a DDP communication hook that runs torch's own default hook
(``allreduce_hook``: divide by the group size, all-reduce, exactly what DDP does without a hook) and records each
bucket it is handed as one ``all_reduce`` of ``S = bucket.buffer().numel() * element_size`` bytes, under the ledger's
rule (``2*(n-1)*S // n`` sent and received; :func:`~lightning_hetero.comm.ledger.wire_bytes`). The bucket sizes are
measured at every call, so gradient accumulation (``no_sync``: no hook call, no bytes), unused parameters and
mixed-precision gradient dtypes are reflected as they happen.

Not counted by the hook: DDP's initial parameter broadcast at construction and, with ``broadcast_buffers=True``, its
broadcast of the module's buffers from rank 0 before every forward (see :func:`ddp_uncounted_traffic`).

Nothing here imports Lightning.
"""

# No ``from __future__ import annotations``: DDP inspects the hook's annotations and refuses strings.
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_hetero.comm.ledger import ByteLedger, validate_label
from lightning_hetero.comm.wrapping import nbytes, record

__all__ = ["CountedAllReduceState", "counted_allreduce_hook", "ddp_uncounted_traffic", "register_counted_allreduce"]

_MARK = "_lightning_hetero_counted_allreduce"


@dataclass
class CountedAllReduceState:
    """State of :func:`counted_allreduce_hook`: where the bytes go and how many buckets were seen."""

    label: str
    """Ledger label of the gradient all-reduce (e.g. ``"intra"`` on one node, ``"inter"`` across nodes)."""
    process_group: Any | None = None
    """DDP's process group (None: WORLD)."""
    ledger: ByteLedger | None = None
    """Ledger to record into (None: the process-global one)."""
    buckets: int = field(default=0, init=False)
    """Bucket all-reduces recorded so far."""


def counted_allreduce_hook(state: CountedAllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: torch's default ``allreduce_hook`` on ``bucket``, recorded in the ledger as one all_reduce."""
    buffer = bucket.buffer()
    group_size = dist.get_world_size(state.process_group)
    future = allreduce_hook(state.process_group, bucket)  # type: ignore[arg-type]  # None means WORLD there too
    record(state.ledger, "all_reduce", state.label, nbytes(buffer), group_size)
    state.buckets += 1
    return future


def register_counted_allreduce(
    model: DistributedDataParallel, label: str, ledger: ByteLedger | None = None
) -> CountedAllReduceState:
    """Register :func:`counted_allreduce_hook` on ``model`` (before its first backward); idempotent per model.

    Args:
        model: The DDP-wrapped model.
        label: Ledger label for the gradient all-reduce.
        ledger: Ledger to record into (default: the process-global one).

    Returns:
        The hook's state (also stored on ``model``).

    Raises:
        TypeError: ``model`` is not a ``DistributedDataParallel``.
        RuntimeError: Another communication hook is already registered (DDP allows one; its traffic is not counted).
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"register_counted_allreduce(model=...) needs a DistributedDataParallel, got {type(model)}.")
    existing = getattr(model, _MARK, None)
    if existing is not None:
        return existing
    state = CountedAllReduceState(validate_label(label), model.process_group, ledger)
    model.register_comm_hook(state, counted_allreduce_hook)  # torch raises if a hook is already registered
    setattr(model, _MARK, state)
    return state


def ddp_uncounted_traffic(model: DistributedDataParallel) -> list[str]:
    """What ``model`` communicates that :func:`counted_allreduce_hook` does not count, one phrase per item."""
    items = ["DDP's initial broadcast of rank 0's parameters and buffers when the model is wrapped"]
    if model.will_sync_module_buffers():
        buffers = [b for b in model.module.buffers() if b.numel()]
        size = sum(nbytes(b) for b in buffers)
        items.append(
            f"DDP's broadcast of the module's {len(buffers)} buffer(s) ({size} bytes) from rank 0 before every "
            "training forward (broadcast_buffers=True; pass DDPStrategy(broadcast_buffers=False) if they never differ)"
        )
    return items
