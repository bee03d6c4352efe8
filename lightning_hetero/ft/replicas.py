"""One replica group (a node) of a fault-tolerant replicate dimension, on torchft's ``Manager``.

Framework-free: a training loop (or a strategy's runtime) drives it per step::

    replica = FaultTolerantReplica(settings, model=model, optimizer=optimizer)
    while replica.current_step() < steps:
        replica.start_step()                       # quorum; a joining replica is healed here, before its forward
        batch = data[replica.current_step()]       # the data position is the committed step: a failed step retries
        loss = model(batch).backward()
        replica.average_gradients(model.parameters())   # mean over the replicas participating this step
        if replica.should_commit():                # False: a peer died mid-step, too few replicas, or an error
            optimizer.step()
        optimizer.zero_grad()

The quorum is synchronous (``use_async_quorum=False``): a joining replica loads a live peer's state (weights,
optimizer state with momenta / error feedback, replicator state, the committed step, RNG, and any extra state)
through :class:`~lightning_hetero.ft.transport.SafeCheckpointTransport` before its first forward, takes part in that
step's average and applies the same update, so after its first step it is bit-identical to the survivors.

Replicators (:mod:`lightning_hetero.replication`) exchange through the Manager once
:meth:`FaultTolerantReplica.manage` set their ``collectives`` hook: :meth:`FaultTolerantReplica.launch` (``"reduce"``
wire: one all-reduce sum; ``"gather"`` wire: every participant writes its bytes into its own slot of a zeroed buffer
and the buffer is all-reduced, which is an all-gather on a group that only offers all-reduce), with the replicator's
``num_replicas`` set to this step's participant count so its average is over the replicas present.

Every tensor handed to the Manager is counted in :mod:`lightning_hetero.comm`'s byte ledger (label ``"inter"``, op
``"all_reduce"`` over the participants, the documented ring rule), so ``comm/inter_bytes_sent`` reports what this
replica put on the wire: for a gather wire that is the all-reduce of the whole slot buffer, ``2 (n - 1) S`` for a
payload of ``S`` bytes (twice an all-gather's ``(n - 1) S``: the price of the slot trick).
"""

from __future__ import annotations

import copy
import logging
import random
import socket
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch

from lightning_hetero import comm
from lightning_hetero.ft._deps import require_torchft
from lightning_hetero.ft.codec import StateLayout
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.replication.base import Bucket, Piece, Replicator

__all__ = ["FaultTolerantReplica"]

log = logging.getLogger("lightning_hetero.ft")

StateFns = Mapping[str, tuple[Callable[[], Any], Callable[[Any], None]]]


class _Done:
    """A finished collective: what :meth:`Replicator.finish` waits on after :meth:`FaultTolerantReplica.launch`."""

    def wait(self) -> bool:
        return True


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class FaultTolerantReplica:
    """This process's replica group in a torchft quorum, with a pickle-free recovery transport.

    Args:
        settings: Lighthouse, minimum replicas, timeouts, replica id source.
        model: The replicated model (its ``state_dict`` is sent to joining replicas).
        optimizer: Its optimizer (state, incl. a replicating optimizer's replicator state, is sent too).
        extra_state: Name -> (get, set) of further state to hand a joining replica (e.g. a data sampler).
        store_host: Host of this group's TCPStore, as the other replica groups reach it (default: this host name).
        store_port: Port of an existing TCPStore of this group (default: start one; group rank 0 only).
        rank: Rank inside the replica group.
        world_size: Ranks in the replica group.
        device: Where the collectives run (``cpu``: gloo, ``cuda``: NCCL).
    """

    def __init__(
        self,
        settings: FaultToleranceSettings,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra_state: StateFns | None = None,
        store_host: str | None = None,
        store_port: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(settings, FaultToleranceSettings):
            raise TypeError(f"settings must be a FaultToleranceSettings, got {type(settings).__name__}.")
        require_torchft()
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        from lightning_hetero.ft.transport import SafeCheckpointTransport

        self.settings = settings
        self.model = model
        self.optimizer = optimizer
        self.extra_state = dict(extra_state or {})
        host = store_host or socket.gethostname()
        timeout = timedelta(seconds=settings.timeout_s)
        self._store = None
        if store_port is None:
            if rank != 0:
                raise ValueError("store_port: ranks other than 0 of a replica group must be given rank 0's store port.")
            self._store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            store_port = self._store.port
        self.transport = SafeCheckpointTransport(
            self._receiver_layout, timeout=timeout, host=host, max_bytes=settings.max_recovery_bytes
        )
        kind = torch.device(device).type
        pg = ProcessGroupNCCL(timeout=timeout) if kind == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=self.load_state_dict,
            state_dict=self.state_dict,
            min_replica_size=settings.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
            connect_timeout=timedelta(seconds=settings.connect_timeout_s),
            rank=rank,
            world_size=world_size,
            store_addr=host,
            store_port=store_port,
            lighthouse_addr=settings.lighthouse_address(),
            replica_id=settings.resolve_replica_id(),
            hostname=host,
            checkpoint_transport=self.transport,
            max_retries=settings.max_retries,
        )
        self.participants_log: list[tuple[int, int]] = []
        """(step, participants) of every committed step, for logs and the fault recipe."""

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer state (momenta, error feedback, replicator state), RNG and the extra state."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": _rng_state(),
            "extra": {name: get() for name, (get, _) in self.extra_state.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (called by the Manager with a live peer's state when this replica joins)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
        for name, (_, set_state) in self.extra_state.items():
            set_state(state["extra"][name])
        log.info("replica healed from a live peer at step %d", self.manager.current_step())

    def _receiver_layout(self) -> StateLayout:
        """This replica's own state as the Manager sends it; per-parameter optimizer state may be absent here yet."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        shapes = {index: tuple(_local(p).shape) for index, p in enumerate(params)}
        base = ("user", "default", "optimizer")
        slot_paths = {(*base, "state"): shapes}
        own = self.state_dict()
        replicator = own["optimizer"].get("replicator")
        if isinstance(replicator, Mapping):  # DiLoCo's per-parameter anchors / outer momentum, created at first sync
            for name, value in replicator.items():
                if isinstance(value, Mapping):
                    slot_paths[(*base, "replicator", name)] = shapes
        return StateLayout.of({"user": {"default": own}, "torchft": self.manager.state_dict()}, slot_paths)

    # ------------------------------------------------------------------------------------------------ steps
    def start_step(self) -> None:
        """Join this step's quorum (waits for ``min_replicas``); a joining replica is healed before it returns.

        Raises:
            PeerPayloadError: The recovery checkpoint a peer sent was refused (the Manager alone would only log it
                and retry forever).
        """
        self.transport.last_error = None
        self.manager.start_quorum()
        if self.transport.last_error is not None:
            raise self.transport.last_error

    def current_step(self) -> int:
        """Committed steps: the data position (a discarded step is retried with the same batch)."""
        return self.manager.current_step()

    def num_participants(self) -> int:
        """Replica groups taking part in this step's average."""
        return self.manager.num_participants()

    def allreduce_(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce ``tensor`` in place over the participants (``"mean"`` or ``"sum"``); errors only fail the commit.

        The bytes go into the process's byte ledger (label ``"inter"``) unless the step already failed, in which case
        the Manager sends nothing.
        """
        from torch.distributed import ReduceOp

        if op not in ("mean", "sum"):
            raise ValueError(f"op={op!r}: use 'mean' or 'sum'.")
        if self.manager.errored() is None:
            self._count_allreduce(tensor)
        work = self.manager.allreduce(tensor, reduce_op=ReduceOp.AVG if op == "mean" else ReduceOp.SUM)
        work.wait()
        return tensor

    def _count_allreduce(self, tensor: torch.Tensor) -> None:
        """Record one all-reduce of ``tensor`` over this step's participants (the Manager's group, synchronous
        quorum: every replica in it participates) by the ledger's counting rule."""
        payload = tensor.numel() * tensor.element_size()
        group = max(self.num_participants(), 1)
        sent, received = comm.wire_bytes("all_reduce", payload, group)
        comm.get_ledger().record("all_reduce", comm.INTER, payload, sent, received, group)

    def average_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Replace every gradient by its mean over the participants (one flat all-reduce; missing grads count 0)."""
        params = [p for p in params if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        self.allreduce_(flat, "mean")
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            size = grad.numel()
            param.grad = flat[offset : offset + size].view_as(grad).to(grad.dtype)
            offset += size

    def gather_bytes(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Every participant's ``payload`` (uint8, same size everywhere), in participant order.

        The Manager's group only offers all-reduce: each participant writes its bytes into its own slot of a zeroed
        buffer and the buffer is summed (0 + byte = byte, no overflow). If the exchange failed (a peer left), every
        slot holds this replica's own bytes, so decoders see a well-formed payload; the step will not commit.
        """
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(
                f"payload must be a 1-D uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}."
            )
        count = self.num_participants()
        slot = self.manager.participating_rank()
        buffer = torch.zeros(max(count, 1) * payload.numel(), dtype=torch.uint8, device=payload.device)
        if slot is not None and slot < count:
            buffer[slot * payload.numel() : (slot + 1) * payload.numel()] = payload
        self.allreduce_(buffer, "sum")
        if self.manager.errored() is not None or slot is None:
            buffer = payload.repeat(max(count, 1))
        return list(buffer.view(max(count, 1), payload.numel()))

    def launch(self, replicator: Replicator, pieces: list[Piece], *, early: bool = False) -> Bucket:
        """:meth:`Replicator.launch` through the Manager: the bucket is complete; ``replicator.finish`` decodes it.

        Sets ``replicator.num_replicas`` to this step's participant count, so means are over the replicas present.
        """
        count = max(self.num_participants(), 1)
        replicator.num_replicas = count
        kind = replicator.wire_kind
        offsets, total = [], 0
        for piece in pieces:
            offsets.append(total)
            total += piece.wire.numel()
        dtype = torch.uint8 if kind == "gather" else torch.float32
        device = pieces[0].wire.device if pieces else torch.device("cpu")
        wires = [piece.wire.to(dtype) if kind == "reduce" else piece.wire for piece in pieces if piece.wire.numel()]
        buffer = torch.cat(wires) if wires else torch.empty(0, dtype=dtype, device=device)
        if kind == "gather":
            output = torch.cat(self.gather_bytes(buffer)) if total else buffer
        else:
            output = buffer.clone()
            if total:
                self.allreduce_(output, "sum")
                if self.manager.errored() is not None:
                    output = buffer * count  # a well-formed stand-in: the step will not commit
        replicator.stats["buckets"] += 1
        replicator.stats["payload_bytes"] += buffer.numel() * buffer.element_size()
        return Bucket(pieces, kind, buffer, output, _Done(), 0.0, early, offsets)

    def manage(self, replicator: Replicator) -> None:
        """Route ``replicator``'s collectives through the Manager (:meth:`launch`) instead of its process group.

        Sets the replicator's ``collectives`` hook (:attr:`Replicator.collectives`): every
        :meth:`Replicator.launch`, also DiLoCo's outer mean (which calls ``FullReplicator.launch`` on the class) and
        the DeMo codec of DiLoCo with ``outer_compression``, hands its pieces to :meth:`launch`; the replicator's
        ``finish`` decodes the completed bucket as usual. DiLoCo's inner steps send nothing.
        """
        replicator.collectives = self
        outer = getattr(replicator, "outer_codec", None)
        if isinstance(outer, Replicator):
            outer.collectives = self

    def step_optimizer(self, step: Callable[[], Any] | None = None) -> bool:
        """Step :attr:`optimizer` and keep the step only if this replica may commit it; return whether it did.

        For optimizers whose exchange happens inside ``step()`` (FlexDeMo's replicating optimizers, with
        :meth:`manage`): the weights, the gradients and the whole optimizer state (momenta, error feedback,
        replicator step) are copied first and restored when :meth:`should_commit` says no, or when the step raises
        (a refused peer payload), so the step can be tried again from the same point (gradients accumulated over
        earlier micro-batches included). Costs one copy of the weights, gradients and optimizer state per step;
        optimizers that exchange gradients before ``step()`` should call :meth:`should_commit` first instead and
        skip the copy.

        Args:
            step: What runs the step (default ``optimizer.step()``): e.g. a Lightning optimizer step whose closure
                runs forward and backward. The copy is taken before it, so an exchange launched during that backward
                (error feedback updated in place) is undone too.
        """
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        weights = [p.detach().clone() for p in params]
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        state = copy.deepcopy(self.optimizer.state_dict())
        try:
            (step or self.optimizer.step)()
            committed = self.should_commit()
        except BaseException:
            self._restore(weights, grads, state)
            raise
        if not committed:
            self._restore(weights, grads, state)
        return committed

    def _restore(self, weights: list[torch.Tensor], grads: list[torch.Tensor | None], state: dict[str, Any]) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for param, saved, grad in zip(params, weights, grads, strict=True):
                param.copy_(saved)
                param.grad = grad
        self.optimizer.load_state_dict(state)

    def should_commit(self) -> bool:
        """Whether to apply this step (all participants healthy, at least ``min_replicas``); advances the step."""
        participants = self.num_participants()
        ok = self.manager.should_commit()
        if ok:
            self.participants_log.append((self.manager.current_step(), participants))
            log.info("step %d committed with %d participating replicas", self.manager.current_step(), participants)
        else:
            log.warning(
                "step %d not committed (participants %d, min %d, error %s); it is retried",
                self.manager.current_step(),
                participants,
                self.settings.min_replicas,
                self.manager.errored(),
            )
        return ok

    def shutdown(self) -> None:
        """Leave the quorum and stop the recovery server."""
        self.manager.shutdown(wait=False)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
