"""What every counted wrapper in :mod:`lightning_hetero.comm.collectives` shares.

Group checks (a world of one without a process group, refusal of foreign groups), the ledger record of one call,
reduce-op names, and the handles that finish a call (AVG division, copy back from the wire dtype). Nothing here
moves bytes: the ``torch.distributed`` communication calls all stay in :mod:`~lightning_hetero.comm.collectives`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_hetero.comm.ledger import ByteLedger, get_ledger, validate_label, wire_bytes

__all__ = [
    "REDUCE_OPS",
    "TORCH_REDUCE_OPS",
    "FinalizingWork",
    "copy_local",
    "finish",
    "group_info",
    "nbytes",
    "record",
    "reduce_op_name",
    "reduction_finalizer",
    "start_call",
]

REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")

TORCH_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # emulated: sum, then divide by the group size
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}
"""The ``torch.distributed.ReduceOp`` each name is sent as."""


class FinalizingWork:
    """Work-like handle whose ``wait()`` also runs a completion step (AVG division, copy back from the wire dtype)."""

    def __init__(self, work: Any | None, finalize: Callable[[], None]) -> None:
        self._work = work
        self._finalize = finalize
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective finished, then finalize the result in place (once)."""
        if self._work is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._done:
            self._finalize()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """True once :meth:`wait` has run the completion step."""
        return self._done


def group_info(group: Any | None, op: str) -> tuple[int, bool]:
    """``(group_size, initialized)``; raises when running alone would silently give wrong results."""
    if dist.is_available() and dist.is_initialized():
        group_size = dist.get_world_size(group)
        if group_size < 1:  # torch would silently skip the call; in our code that is always a bug
            raise ValueError(
                f"lightning_hetero.comm.{op}: global rank {dist.get_rank()} is not a member of the given process group."
            )
        return group_size, True
    expected = os.environ.get("WORLD_SIZE", "1")
    if expected.strip() not in ("", "1") or group is not None:
        raise RuntimeError(
            f"lightning_hetero.comm.{op}: torch.distributed is not initialized but WORLD_SIZE={expected!r}"
            f"{' and a group was given' if group is not None else ''}. Call torch.distributed.init_process_group"
            " first (Lightning strategies do this in setup_environment), or unset WORLD_SIZE for a single process."
        )
    return 1, False


def start_call(op: str, label: str, group: Any | None) -> tuple[int, bool]:
    """The checks every counted call starts with: a valid ``label``, then :func:`group_info`."""
    validate_label(label)
    return group_info(group, op)


def record(ledger: ByteLedger | None, op: str, label: str, payload: int, group_size: int, **formula: Any) -> None:
    """Record one call with this rank's bytes under the counting rule (:func:`~.ledger.wire_bytes`)."""
    sent, received = wire_bytes(op, payload, group_size, **formula)
    (ledger if ledger is not None else get_ledger()).record(op, label, payload, sent, received, group_size)


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def reduce_op_name(op: str | dist.ReduceOp) -> str:
    """The name in :data:`REDUCE_OPS` of a reduce op given by name (any case) or as a ``torch.distributed.ReduceOp``."""
    if isinstance(op, str):
        name = op.lower()
        if name in TORCH_REDUCE_OPS:
            return name
    else:
        for name, torch_op in TORCH_REDUCE_OPS.items():
            if name != "avg" and op == torch_op:
                return name
        if op == dist.ReduceOp.AVG:
            return "avg"
    raise ValueError(f"Unsupported reduce op {op!r}; use one of {list(REDUCE_OPS)}.")


def finish(work: Any | None, finalize: Callable[[], None] | None, async_op: bool) -> Any | None:
    """Return the right handle: raw Work when nothing is left to do, else one that finalizes on ``wait()``."""
    if not async_op:
        if finalize is not None:
            finalize()
        return None
    if finalize is None and work is not None:
        return work
    return FinalizingWork(work, finalize or (lambda: None))


def copy_local(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """What a world of one does instead of a collective: copy ``tensor`` into ``output``."""
    output.copy_(tensor.reshape(output.shape))


def reduction_finalizer(
    wire: torch.Tensor, target: torch.Tensor, write_back: Callable[[torch.Tensor], None], name: str, n: int
) -> Callable[[], None] | None:
    """What is left after a reduction lands in ``wire``: divide for ``"avg"``, copy an upcast back into ``target``."""
    if wire is target and not (name == "avg" and n > 1):
        return None

    def finalize() -> None:
        if name == "avg":
            wire.div_(n)
        write_back(wire)

    return finalize
