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

A replica group may hold several ranks (FSDP2 inside a node): each rank builds its own replica with ``rank`` (its
group rank) and ``world_size`` (the group's ranks), group rank 0 starting the group's TCPStore. torchft's process group
of group rank ``i`` connects rank ``i`` of every replica group, so each rank exchanges its own shard, and a joining
group's rank ``i`` is healed from rank ``i`` of a live group with that rank's local shards.

Replicators (:mod:`lightning_hetero.replication`) exchange through the Manager once
:meth:`FaultTolerantReplica.manage` set their ``collectives`` hook: :meth:`FaultTolerantReplica.launch`, with the
replicator's ``num_replicas`` set to this step's participant count so its average is over the replicas present.

Every contribution (a gradient, a reduce wire, a gather wire's bytes) travels as an authenticated slot: one
all-gather over the Manager's group of ``payload || HMAC tag`` (:mod:`lightning_hetero.ft.slots`, 32 bytes per slot,
under the cluster secret of :mod:`lightning_hetero.ft.membership`); a slot that does not verify discards the step.
Means and sums are formed locally, in slot order, from the checked contributions
(:func:`~lightning_hetero.ft.checks.combine_contributions`). Each exchange is counted in
:mod:`lightning_hetero.comm`'s byte ledger (label ``"inter"``, op ``"all_gather"``), so
``comm/inter/bytes_sent_step`` reports what this replica put on the wire: ``(n - 1) (S + 32)`` for a payload of
``S`` bytes. A replica healing a peer validates the whole received state first
(:func:`~lightning_hetero.ft.checks.validate_recovered`) and never applies half of it.
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

from lightning_hetero.comm.timing import wall_clock
from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.ft._deps import require_torchft
from lightning_hetero.ft.checks import combine_contributions, validate_recovered
from lightning_hetero.ft.codec import StateLayout
from lightning_hetero.ft.membership import load_secret
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.ft.slots import SlotExchange
from lightning_hetero.ft.waiting import QuorumWait
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
        self.store_port = int(store_port)
        """This replica group's TCPStore port (group rank 0 hands it to the other ranks)."""
        self.group_rank = rank
        """This rank inside its replica group: it exchanges with, heals from and heals the same group rank of the
        other replica groups."""
        self.group_size = world_size
        """Ranks in the replica group (FSDP2 inside the node; every replica group must have the same)."""
        self.secret = load_secret(settings.secret_file, settings.secret_env, required=settings.require_secret)
        """The cluster secret (membership): its ``repr`` is redacted and it cannot be pickled."""
        self._slots: Any = None
        self.dropped_contributions = 0
        """Contributions left out of a mean by :func:`~lightning_hetero.ft.checks.combine_contributions`."""
        self.transport = SafeCheckpointTransport(
            self._receiver_layout,
            timeout=timeout,
            host=host,
            max_bytes=settings.max_recovery_bytes,
            secret=self.secret,
            cluster=settings.cluster_id,
            bind=settings.recovery_bind,
            validate=self._validate_recovered,
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
            quorum_retries=settings.quorum_retries,
        )
        self.quorum_wait = QuorumWait(settings)
        """Re-asks a failed quorum until ``wait_for_replicas_s`` (below ``min_replicas``, lighthouse down)."""
        self.participants_log: list[tuple[int, int]] = []
        """(step, participants) of every committed step, for logs and the fault recipe."""

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer state (momenta, error feedback, replicator state), RNG and the extra state.

        Weights are this rank's local tensors: an FSDP2 ``DTensor`` parameter contributes its local shard, which the
        same group rank of a joining replica group loads into its own shard (:func:`_load_model`).
        """
        return {
            "model": {name: _local(value) for name, value in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "rng": _rng_state(),
            "extra": {name: get() for name, (get, _) in self.extra_state.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (called by the Manager with a live peer's state when this replica joins).

        The transport validated the whole state before (:meth:`_validate_recovered`); should a part still fail to
        load (an ``extra_state`` setter refusing its value), everything loaded so far is rolled back to this
        replica's own state and :class:`PeerPayloadError` is raised: never a half-healed replica.
        """
        own = copy.deepcopy(self.state_dict())
        try:
            self._apply_state(state)
        except Exception as error:
            self._apply_state(own)
            if isinstance(error, PeerPayloadError):  # a setter's own refusal names its field: keep it
                raise
            raise PeerPayloadError(
                f"recovery checkpoint refused while loading ({type(error).__name__}: {str(error)[:200]}); this"
                " replica's own state was restored.",
                None,
                "load",
            ) from error
        log.info("replica healed from a live peer at step %d", self.manager.current_step())

    def _apply_state(self, state: Mapping[str, Any]) -> None:
        _load_model(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
        for name, (_, set_state) in self.extra_state.items():
            set_state(state["extra"][name])

    def _own_recovery_state(self) -> dict[str, Any]:
        """This replica's state in the form the Manager sends (``{"user": {"default": ...}, "torchft": ...}``)."""
        return {"user": {"default": self.state_dict()}, "torchft": self.manager.state_dict()}

    def _validate_recovered(self, state: Any, peer: int, step: int) -> None:
        """The whole received state against this replica's own (:func:`~lightning_hetero.ft.checks.validate_recovered`),
        before the Manager applies any of it."""
        validate_recovered(state, self._own_recovery_state(), step=step, peer=peer)

    def _receiver_layout(self) -> StateLayout:
        """This replica's own state as the Manager sends it; per-parameter optimizer state may be absent here yet."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        shapes = {index: tuple(_local(p).shape) for index, p in enumerate(params)}
        base = ("user", "default", "optimizer")
        slot_paths = {(*base, "state"): shapes}
        mine = self._own_recovery_state()
        own = mine["user"]["default"]
        replicator = own["optimizer"].get("replicator")
        if isinstance(replicator, Mapping):  # DiLoCo's per-parameter anchors / outer momentum, created at first sync
            for name, value in replicator.items():
                if isinstance(value, Mapping):
                    slot_paths[(*base, "replicator", name)] = shapes
        return StateLayout.of(mine, slot_paths)

    # ------------------------------------------------------------------------------------------------ steps
    def start_step(self) -> None:
        """Join this step's quorum (waits for ``min_replicas``); a joining replica is healed before it returns.

        While fewer than ``min_replicas`` are present, or the lighthouse is down, it waits: each failed quorum
        attempt logs ``waiting for replicas: ...`` and asks again (:class:`~lightning_hetero.ft.waiting.QuorumWait`).

        Raises:
            PeerPayloadError: The recovery checkpoint a peer sent was refused (the Manager alone would only log it
                and retry forever).
            ReplicasBelowMinimumError: Still no quorum ``settings.wait_for_replicas_s`` after the first failed
                attempt (torchft's raw error is its cause).
        """
        self.transport.last_error = None
        self.quorum_wait.run(self._start_quorum, self._forget_failed_quorum)
        if self.transport.last_error is not None:
            raise self.transport.last_error

    def _start_quorum(self, timeout: timedelta) -> None:
        self.manager.start_quorum(timeout=timeout)

    def _forget_failed_quorum(self) -> None:
        # torchft 0.2.0 keeps the failed quorum's future and re-raises it at the next start_quorum: drop it, so the
        # next attempt asks the lighthouse again (the Manager itself is still usable; its managed group is unchanged).
        self.manager._quorum_future = None

    def current_step(self) -> int:
        """Committed steps: the data position (a discarded step is retried with the same batch)."""
        return self.manager.current_step()

    def num_participants(self) -> int:
        """Replica groups taking part in this step's average."""
        return self.manager.num_participants()

    @property
    def slots(self) -> SlotExchange:
        """The authenticated slot exchange over the Manager's group (:mod:`lightning_hetero.ft.slots`)."""
        if self._slots is None:
            cluster = self.settings.cluster_id
            if self.group_size > 1:  # group rank i exchanges only with group rank i: a tag is valid in its own group
                cluster = f"{cluster}/group-rank-{self.group_rank}-of-{self.group_size}"
            self._slots = SlotExchange(self.manager, self.secret, cluster)
        return self._slots

    def allreduce_(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce ``tensor`` (floating point) in place over the participants (``"mean"`` or ``"sum"``).

        Every participant's contribution travels in its own authenticated slot (:meth:`gather_bytes`) and is
        checked before it is combined (:func:`~lightning_hetero.ft.checks.combine_contributions`: finite, bounded,
        the outlier rule); a refused contribution is left out on every replica alike (the mean is over the kept
        ones, a sum is scaled to all participants). Errors only fail the commit: when the exchange failed, was
        tampered with, or nothing usable is left, ``tensor`` is left as it was and the step will not commit.
        """
        if op not in ("mean", "sum"):
            raise ValueError(f"op={op!r}: use 'mean' or 'sum'.")
        if not tensor.is_floating_point():
            raise ValueError(f"tensor must be floating point, got {tensor.dtype}.")
        flat = tensor.detach().reshape(-1).contiguous()
        gathered = self.slots.gather(flat.view(torch.uint8))
        if gathered is None:
            return tensor
        count = len(gathered)
        contributions = [slot.view(flat.dtype) for slot in gathered]
        try:
            combined = combine_contributions(
                contributions, outlier_factor=self.settings.outlier_factor, names=self.slots.names(count)
            )
        except PeerPayloadError as error:
            log.warning("%s", error)
            self.manager.report_error(error)
            return tensor
        for reason in combined.refused.values():
            log.warning("step %d: %s; left out of the mean on every replica", self.current_step(), reason)
        self.dropped_contributions += len(combined.refused)
        total = combined.total  # a fresh tensor: scaled in place
        if op == "mean":
            total.div_(len(combined.kept))
        elif combined.refused:
            total.mul_(count / len(combined.kept))  # a sum over all participants, as the caller divides by n
        with torch.no_grad():
            tensor.copy_(total.view_as(tensor))
        return tensor

    def average_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Replace every gradient by its mean over the participants (one authenticated exchange of the flat
        gradient, checked before it is applied; missing grads count 0)."""
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
        """Every participant's ``payload`` (uint8, same size everywhere), authenticated, in participant order.

        One all-gather of ``payload || tag`` (:class:`~lightning_hetero.ft.slots.SlotExchange`); every other
        participant's tag is verified. If the exchange failed (a peer left) or a slot did not authenticate (a
        non-member, a flipped bit, a replay), every slot holds this replica's own bytes, so decoders see a well-formed
        payload; the step will not commit.
        """
        gathered = self.slots.gather(payload)
        if gathered is None:
            count = max(self.num_participants(), 1)
            return list(payload.repeat(count).view(count, payload.numel()))
        return gathered

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
        launched_at = wall_clock()  # the exchange is synchronous: launched and completed inside this call
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
        return Bucket(pieces, kind, buffer, output, _Done(), launched_at, early, offsets, completed_at=wall_clock())

    def manage(self, replicator: Replicator) -> None:
        """Route ``replicator``'s collectives through the Manager (:meth:`launch`) instead of its process group.

        Sets the replicator's ``collectives`` hook (:attr:`Replicator.collectives`): every
        :meth:`Replicator.launch`, also DiLoCo's outer mean (which calls ``FullReplicator.launch`` on the class) and
        the DeMo codec of DiLoCo with ``outer_kept_fraction``, hands its pieces to :meth:`launch`; the replicator's
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


def _load_model(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Load ``state`` (local tensors, as :meth:`FaultTolerantReplica.state_dict` sends them) into ``model``.

    FSDP2 parameters are DTensors: this rank's local shard takes the received tensor in place (the sender was the
    same group rank of another replica group, the codec checked the local shapes). Without DTensors, the module's
    own ``load_state_dict``.
    """
    own = model.state_dict(keep_vars=True)
    if not any(_local(value) is not value for value in own.values() if isinstance(value, torch.Tensor)):
        model.load_state_dict(state)
        return
    missing = sorted(set(own) ^ set(state))
    if missing:
        raise KeyError(f"model state keys differ from this replica's: {missing[:5]}")
    with torch.no_grad():
        for name, value in own.items():
            if isinstance(value, torch.Tensor):
                _local(value).copy_(state[name])
