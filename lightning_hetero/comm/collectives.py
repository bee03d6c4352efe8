"""Counted collectives: the only module in lightning-hetero that calls ``torch.distributed`` communication.

Every wrapper takes a mandatory keyword ``label`` (which link the bytes use, e.g. ``INTER``), an optional ``group``
(default: WORLD), ``async_op`` and ``ledger`` (default: :func:`~lightning_hetero.comm.ledger.get_ledger`). It runs
the collective and records one :class:`~lightning_hetero.comm.ledger.CommRecord` with this rank's bytes, at issue
time for ``async_op=True``. ``barrier`` is not recorded.

Counting rule (idealized ring / direct algorithms). ``S`` is the payload in bytes as the wire sees it (see dtypes
below), ``S_local`` this rank's contribution, ``n`` the group size; ``//`` is floor division, applied once at the end:

=========================  ========================================  ========================================
op                         sent by this rank                         received by this rank
=========================  ========================================  ========================================
all_reduce (S = tensor)    ``2*(n-1)*S // n``                        ``2*(n-1)*S // n``
all_gather[_into_tensor]   ``(n-1)*S_local``                         ``(n-1)*S_local``
reduce_scatter_tensor      ``(n-1)*S // n`` (S = the full input)     ``(n-1)*S // n``
broadcast                  root: ``(n-1)*S``; others: 0              root: 0; others: ``S``
send / isend               ``S``                                     0
recv / irecv               0                                         ``S``
all_to_all_single          ``S_in - own``                            ``S_out - own``
=========================  ========================================  ========================================

``own`` is the block a rank sends to itself (``S_in // n`` for an even split, ``input_split_sizes[rank]`` rows
otherwise); it never leaves the process. A group of size 1 puts nothing on the wire: every formula gives 0. The
all_reduce rule is ring reduce-scatter plus ring all-gather. Backends may use other algorithms: NCCL picks trees
for small messages, gloo's ``broadcast`` is a binomial tree (relaying ranks also send), and gloo implements
``reduce_scatter_tensor`` as a full all_reduce followed by a local copy of this rank's chunk (so gloo really moves
about ``2*(n-1)*S/n``). The ledger reports the rule above (:func:`~lightning_hetero.comm.ledger.wire_bytes`), which
is what an efficient implementation needs; the bandwidth testbed measures the real wire.

Dtypes gloo lacks (int16, uint16, uint32, uint64, the float8 family and other exotic dtypes; see
:mod:`lightning_hetero.comm.dtypes`):

- non-reducing collectives (all_gather*, broadcast, all_to_all_single, send/recv) bit-cast through
  ``.view(torch.uint8)``; values round-trip exactly and the byte count is unchanged;
- reductions (all_reduce, reduce_scatter_tensor) upcast: int16/uint16 -> int32, uint32 -> int64, float8 -> float32;
  uint64 is reinterpreted as int64 (sum/product/bitwise ops are identical in two's complement; min/max flip the
  sign bit to keep the unsigned order). The result is cast back with a wrapping (modulo 2**bits) integer cast, which
  equals what a native wrapping reduction would give; float8 is rounded back by torch's cast. Reductions are
  **counted at the dtype actually sent**: an int16 all_reduce of ``k`` elements has ``S = 4k``. If that matters,
  all_gather the int16 payload instead (bit-cast, counted at 2 bytes per element) and reduce locally.

``op="avg"`` is always computed as a sum followed by an in-place division by ``n`` (gloo has no ``ReduceOp.AVG``);
with ``async_op=True`` the division happens in the returned handle's ``wait()``, so call it before reading.

:class:`CountedFSDPAllGather` and :class:`CountedFSDPReduceScatter` are FSDP2's own default collectives with a ledger
record added, for ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``
(:mod:`lightning_hetero.comm.fsdp_comm` installs them).

Calling a wrapper with a group this rank does not belong to raises ``ValueError`` (torch would silently do nothing).
Without an initialized process group the wrappers act as a world of one (identity / copy, 0 bytes, the call still
recorded) unless the ``WORLD_SIZE`` environment variable says there should be more ranks, which raises instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_hetero.comm.dtypes import GLOO_NATIVE_DTYPES, as_wire_input, as_wire_output, reduction_wire
from lightning_hetero.comm.ledger import ByteLedger, validate_label
from lightning_hetero.comm.wrapping import (
    TORCH_REDUCE_OPS,
    copy_local,
    finish,
    group_info,
    nbytes,
    record,
    reduce_op_name,
    reduction_finalizer,
    start_call,
)

__all__ = [
    "CountedFSDPAllGather",
    "CountedFSDPReduceScatter",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "irecv",
    "isend",
    "recv",
    "reduce_scatter_tensor",
    "send",
]


def _check_same_dtype(output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise ValueError(f"output dtype {output.dtype} must match input dtype {input.dtype}.")


# torch 2.13 renamed the tensor forms; the FSDP2 comms call the same functions as the wrappers.
def _dist_all_gather_into_tensor() -> Callable[..., Any]:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _dist_reduce_scatter_tensor() -> Callable[..., Any]:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------------------- reductions
def all_reduce(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    *,
    label: str,
    group: Any | None = None,
    async_op: bool = False,
    ledger: ByteLedger | None = None,
) -> Any | None:
    """Reduce ``tensor`` in place across the group.

    Args:
        tensor: Reduced in place.
        op: ``"sum"``, ``"avg"``, ``"product"``, ``"min"``, ``"max"``, ``"band"``, ``"bor"``, ``"bxor"`` or the
            matching ``torch.distributed.ReduceOp``. ``"avg"`` is sum then divide (floating dtypes only).
        label: Link label recorded in the ledger, e.g. ``INTER``.
        group: Process group (default WORLD).
        async_op: Return a handle; call its ``wait()`` before reading ``tensor``.
        ledger: Ledger to record into (default: the process-global one).

    Returns:
        A Work-like handle when ``async_op`` else None.
    """
    n, initialized = start_call("all_reduce", label, group)
    name = reduce_op_name(op)
    wire, write_back = reduction_wire(tensor, name)
    work = dist.all_reduce(wire, op=TORCH_REDUCE_OPS[name], group=group, async_op=async_op) if initialized else None
    record(ledger, "all_reduce", label, nbytes(wire), n)
    return finish(work, reduction_finalizer(wire, tensor, write_back, name, n), async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str | dist.ReduceOp = "sum",
    *,
    label: str,
    group: Any | None = None,
    async_op: bool = False,
    ledger: ByteLedger | None = None,
) -> Any | None:
    """Reduce ``input`` (n equal chunks along dim 0) across the group; this rank's chunk lands in ``output``.

    Args:
        output: Receives this rank's reduced chunk (``input.numel() // n`` elements, same dtype).
        input: The full tensor to reduce; counted as ``S``.
        op: As in :func:`all_reduce`.
        label, group, async_op, ledger: As in :func:`all_reduce`.

    Returns:
        A Work-like handle when ``async_op`` else None.
    """
    n, initialized = start_call("reduce_scatter_tensor", label, group)
    name = reduce_op_name(op)
    _check_same_dtype(output, input)
    wire_in, _ = reduction_wire(input, name)
    wire_out, write_back = reduction_wire(output, name)
    if not initialized:
        work = None
        copy_local(wire_out, wire_in)
    else:
        reduce_scatter = _dist_reduce_scatter_tensor()
        work = reduce_scatter(wire_out, wire_in, op=TORCH_REDUCE_OPS[name], group=group, async_op=async_op)
    record(ledger, "reduce_scatter_tensor", label, nbytes(wire_in), n)
    return finish(work, reduction_finalizer(wire_out, output, write_back, name, n), async_op)


# ------------------------------------------------------------------------------------------------ data movement
def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    label: str,
    group: Any | None = None,
    async_op: bool = False,
    ledger: ByteLedger | None = None,
) -> Any | None:
    """Gather every rank's ``input`` into ``output`` (concatenated along dim 0, rank order).

    Args:
        output: ``n`` times the size of ``input``, same dtype; contiguous when the dtype is bit-cast.
        input: This rank's contribution; counted as ``S_local``.
        label, group, async_op, ledger: As in :func:`all_reduce`.

    Returns:
        A Work handle when ``async_op`` else None.
    """
    n, initialized = start_call("all_gather_into_tensor", label, group)
    _check_same_dtype(output, input)
    if not initialized:
        work = None
        copy_local(output, input)
    else:
        all_gather_single = _dist_all_gather_into_tensor()
        work = all_gather_single(as_wire_output(output, "output"), as_wire_input(input), group=group, async_op=async_op)
    record(ledger, "all_gather_into_tensor", label, nbytes(input), n)
    return finish(work, None, async_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    *,
    label: str,
    group: Any | None = None,
    async_op: bool = False,
    ledger: ByteLedger | None = None,
) -> Any | None:
    """Gather every rank's ``tensor`` into ``tensor_list[rank]``.

    Args:
        tensor_list: ``n`` tensors shaped like ``tensor``; contiguous when the dtype is bit-cast.
        tensor: This rank's contribution; counted as ``S_local``.
        label, group, async_op, ledger: As in :func:`all_reduce`.

    Returns:
        A Work handle when ``async_op`` else None.
    """
    n, initialized = start_call("all_gather", label, group)
    if len(tensor_list) != n:
        raise ValueError(f"tensor_list must hold one tensor per rank ({n}), got {len(tensor_list)}.")
    if not initialized:
        work = None
        copy_local(tensor_list[0], tensor)
    else:
        outputs = [as_wire_output(t, f"tensor_list[{i}]") for i, t in enumerate(tensor_list)]
        work = dist.all_gather(outputs, as_wire_input(tensor), group=group, async_op=async_op)
    record(ledger, "all_gather", label, nbytes(tensor), n)
    return finish(work, None, async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    *,
    label: str,
    group: Any | None = None,
    async_op: bool = False,
    ledger: ByteLedger | None = None,
) -> Any | None:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group, in place.

    Args:
        tensor: Source on ``src``, overwritten elsewhere; contiguous when the dtype is bit-cast.
        src: Global rank of the root.
        label, group, async_op, ledger: As in :func:`all_reduce`.

    Returns:
        A Work handle when ``async_op`` else None.
    """
    n, initialized = start_call("broadcast", label, group)
    if not initialized:
        if src != 0:
            raise ValueError(f"broadcast src={src} does not exist in a single-process run (only rank 0).")
        work, rank = None, 0
    else:
        work = dist.broadcast(as_wire_output(tensor, "tensor"), src=src, group=group, async_op=async_op)
        rank = dist.get_rank()
    record(ledger, "broadcast", label, nbytes(tensor), n, rank=rank, src=src)
    return finish(work, None, async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    *,
    label: str,
    group: Any | None = None,
    async_op: bool = False,
    ledger: ByteLedger | None = None,
) -> Any | None:
    """Scatter blocks of ``input`` (along dim 0) to every rank and gather theirs into ``output``.

    Args:
        output: Receives the blocks, rank order; contiguous when the dtype is bit-cast.
        input: This rank's blocks; rank ``j`` gets the ``j``-th. Counted as ``S_in``.
        output_split_sizes: Rows received from each rank (default: equal split).
        input_split_sizes: Rows sent to each rank (default: equal split).
        label, group, async_op, ledger: As in :func:`all_reduce`.

    Returns:
        A Work handle when ``async_op`` else None.
    """
    n, initialized = start_call("all_to_all_single", label, group)
    _check_same_dtype(output, input)
    row_in = nbytes(input) // input.shape[0] if input.dim() and input.shape[0] else 0
    row_out = nbytes(output) // output.shape[0] if output.dim() and output.shape[0] else 0
    rank = dist.get_rank(group) if initialized else 0
    own = nbytes(input) // n if input_split_sizes is None else input_split_sizes[rank] * row_in
    if not initialized:
        work = None
        copy_local(output, input)
    elif input.dtype in GLOO_NATIVE_DTYPES:
        work = dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
    else:  # bit-cast: a flat uint8 view, so split sizes are counted in bytes instead of rows
        out_splits = None if output_split_sizes is None else [s * row_out for s in output_split_sizes]
        in_splits = None if input_split_sizes is None else [s * row_in for s in input_split_sizes]
        work = dist.all_to_all_single(
            as_wire_output(output, "output"),
            as_wire_input(input),
            out_splits,
            in_splits,
            group=group,
            async_op=async_op,
        )
    record(ledger, "all_to_all_single", label, nbytes(input), n, output_bytes=nbytes(output), own_block_bytes=own)
    return finish(work, None, async_op)


# --------------------------------------------------------------------------------------------- point to point
def _point_to_point(
    op: str,
    call: Callable[..., Any],
    tensor: torch.Tensor,
    peer: Mapping[str, int | None],
    *,
    label: str,
    group: Any | None,
    tag: int,
    ledger: ByteLedger | None,
) -> Any:
    """Run ``call`` (``dist.send``, ``dist.irecv``, ...) on ``tensor``'s wire form and record ``S`` = its bytes."""
    n, initialized = start_call(op, label, group)
    if not initialized:
        raise RuntimeError(f"lightning_hetero.comm.{op} needs an initialized process group with a peer.")
    receiving = op in ("recv", "irecv")
    wire = as_wire_output(tensor, "tensor") if receiving else as_wire_input(tensor)
    result = call(wire, **peer, group=group, tag=tag)
    record(ledger, op, label, nbytes(tensor), n)
    return result


def send(
    tensor: torch.Tensor,
    dst: int,
    *,
    label: str,
    group: Any | None = None,
    tag: int = 0,
    ledger: ByteLedger | None = None,
) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking); records ``S`` sent."""
    _point_to_point("send", dist.send, tensor, {"dst": dst}, label=label, group=group, tag=tag, ledger=ledger)


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    *,
    label: str,
    group: Any | None = None,
    tag: int = 0,
    ledger: ByteLedger | None = None,
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any rank when None, blocking); returns the sender's rank."""
    return _point_to_point("recv", dist.recv, tensor, {"src": src}, label=label, group=group, tag=tag, ledger=ledger)


def isend(
    tensor: torch.Tensor,
    dst: int,
    *,
    label: str,
    group: Any | None = None,
    tag: int = 0,
    ledger: ByteLedger | None = None,
) -> Any:
    """Start sending ``tensor`` to global rank ``dst``; returns the Work handle. Bytes are recorded now."""
    return _point_to_point("isend", dist.isend, tensor, {"dst": dst}, label=label, group=group, tag=tag, ledger=ledger)


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    *,
    label: str,
    group: Any | None = None,
    tag: int = 0,
    ledger: ByteLedger | None = None,
) -> Any:
    """Start receiving into ``tensor`` from global rank ``src``; returns the Work handle. Bytes are recorded now."""
    return _point_to_point("irecv", dist.irecv, tensor, {"src": src}, label=label, group=group, tag=tag, ledger=ledger)


def barrier(*, group: Any | None = None, async_op: bool = False) -> Any | None:
    """Synchronize the group. Not recorded in the ledger (no payload); a no-op in a single uninitialized process."""
    _, initialized = group_info(group, "barrier")
    if not initialized:
        return finish(None, None, async_op)
    return dist.barrier(group=group, async_op=async_op)


# ------------------------------------------------------------------------------------------ FSDP2 custom comms
try:  # the base classes FSDPModule.set_custom_all_gather / set_custom_reduce_scatter expect (torch >= 2.7)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _FSDPAllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _FSDPReduceScatter
except ImportError:  # pragma: no cover - older torch: FSDP2 only duck-types these
    _FSDPAllGather = _FSDPReduceScatter = object  # type: ignore[assignment,misc]


class _CountedFSDPComm:
    """What both FSDP2 comms share: their label and ledger, FSDP's default allocation, and the counted call."""

    def __init__(self, label: str, ledger: ByteLedger | None = None) -> None:
        self.label = validate_label(label)
        self.ledger = ledger

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's default allocation: a plain empty tensor."""
        return torch.empty(*size, dtype=dtype, device=device)

    def _counted(
        self, name: str, call: Callable[..., Any], output: torch.Tensor, input: torch.Tensor, group: Any, **kwargs: Any
    ) -> Any | None:
        """Run FSDP's own ``call(output, input, group=group, **kwargs)``, recorded as ``name`` (S = ``input``)."""
        n, _ = group_info(group, name)
        work = call(output, input, group=group, **kwargs)
        record(self.ledger, name, self.label, nbytes(input), n)
        return work


class CountedFSDPAllGather(_CountedFSDPComm, _FSDPAllGather):  # type: ignore[misc]
    """FSDP2's parameter all-gather, counted: the call FSDP makes by default, recorded as ``all_gather_into_tensor``.

    Install with ``fsdp_module.set_custom_all_gather(CountedFSDPAllGather(label))`` (see
    :func:`lightning_hetero.comm.fsdp_comm.count_fsdp2`). The collective, its reduce op and its numerics are FSDP's
    own; only the ledger record is added (``S_local`` = this rank's flat shard input).
    """

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any | None:
        return self._counted(
            "all_gather_into_tensor",
            _dist_all_gather_into_tensor(),
            output_tensor,
            input_tensor,
            group,
            async_op=async_op,
        )


class CountedFSDPReduceScatter(_CountedFSDPComm, _FSDPReduceScatter):  # type: ignore[misc]
    """FSDP2's gradient reduce-scatter, counted: FSDP's default call, recorded as ``reduce_scatter_tensor``.

    Install with ``fsdp_module.set_custom_reduce_scatter(CountedFSDPReduceScatter(label))``. ``S`` is the full flat
    gradient input (padded as FSDP pads it), in the reduce dtype FSDP chose.
    """

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any | None:
        return self._counted(
            "reduce_scatter_tensor",
            _dist_reduce_scatter_tensor(),
            output_tensor,
            input_tensor,
            group,
            op=op,
            async_op=async_op,
        )
