"""One replica group's optimizer steps, gated on the torchft quorum: the fault-tolerant piece a strategy runtime uses.

A strategy runtime (FlexDeMo's today) owns one :class:`QuorumSteps`. Outside the fault-tolerant mode it holds no
replica and every call is a no-op (``committed_step`` just runs the step), so the runtime calls it unconditionally.
In the mode (``docs/spot.md``) :meth:`QuorumSteps.join` builds the
:class:`~lightning_hetero.ft.replicas.FaultTolerantReplica` (torchft's Manager behind the lighthouse); each step
joins the quorum once before its first forward (:meth:`start_step`, where a joiner is healed) and the optimizer step
is kept only if the quorum commits it (:meth:`committed_step`), retried in a new quorum otherwise.

Framework-free: the adapters decide when to call it; nothing here imports Lightning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lightning_hetero import comm
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.replication.base import Replicator

__all__ = ["QuorumSteps", "check_fault_tolerant_world"]

log = logging.getLogger(__name__)

StateFns = tuple[Callable[[], Any], Callable[[Any], None]]


def check_fault_tolerant_world(
    settings: FaultToleranceSettings | None, owner: str, nodes: int, ranks: int, shard_size: int | None = None
) -> None:
    """The fault-tolerant mode runs one launch per replica group (node), its ranks sharding one model copy; raise
    naming the fix.

    A replica group may hold several ranks (FSDP2 inside the node): each rank joins the quorum as its group rank and
    exchanges its own shard with the same group rank of every other replica group (``docs/spot.md``).

    Args:
        settings: The fault-tolerant mode's settings (None: nothing to check).
        owner: Class name used in messages.
        nodes: Nodes of this launch.
        ranks: Ranks per node of this launch (the replica group's ranks).
        shard_size: Ranks that shard one model copy, when known (None: every rank of the node).

    Raises:
        ValueError: The launch spans several nodes, or its ranks hold more than one model copy.
    """
    if settings is None:
        return
    if nodes > 1:
        raise ValueError(
            f"{owner}(settings.fault_tolerance=...): this launch spans {nodes} nodes, but in the "
            "fault-tolerant mode every node is its own replica group and its own launch (a node may die and "
            "rejoin without the others restarting). Start one job per node with num_nodes=1 (torchrun "
            "--nnodes 1 / Trainer(num_nodes=1)) and a distinct REPLICA_GROUP_ID each, all pointing at the same "
            "lighthouse; see docs/spot.md."
        )
    if shard_size is not None and shard_size != ranks:
        raise ValueError(
            f"{owner}(settings.fault_tolerance=..., settings.shard_size={shard_size}): the {ranks} ranks of this "
            f"replica group would hold {max(ranks // max(shard_size, 1), 1)} model copies, but in the fault-tolerant "
            "mode one replica group (one launch) is one model copy sharded over all its ranks. Leave "
            f"settings.shard_size=None (or set it to {ranks}); see docs/spot.md."
        )


class QuorumSteps:
    """The quorum-gated steps of one replica group (no-ops until :meth:`join`)."""

    def __init__(self) -> None:
        self.replica: Any | None = None
        """The :class:`~lightning_hetero.ft.replicas.FaultTolerantReplica` from :meth:`join` to :meth:`leave`."""
        self.recovery_state: dict[str, StateFns] = {}
        """Name -> (get, set) of further state a joining replica takes from a live peer (e.g. LR schedulers)."""
        self.step_open = False
        """This step's quorum was joined and its optimizer step has not run yet."""
        self.last_commit: bool | None = None
        """Whether the last optimizer step was committed (None before the first)."""
        self.last_retries = 0
        """Discarded tries before the last optimizer step committed (``retry=True`` only)."""
        self.batch_step: int | None = None
        """Committed steps when the current batch was drawn (:meth:`begin_batch`); None before the first."""
        self.abandoned_batches = 0
        """Batches dropped because the quorum committed their step without this replica group (:meth:`overtaken`)."""
        self.last_abandoned = False
        """Whether the last :meth:`committed_step` dropped its batch instead of stepping."""

    @property
    def active(self) -> bool:
        """Whether this replica group is in a quorum (between :meth:`join` and :meth:`leave`)."""
        return self.replica is not None

    def join(
        self,
        settings: FaultToleranceSettings,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        replicator: Replicator | None,
        device: torch.device | str,
        owner: str,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """Join the torchft quorum as this rank of the replica group; ``replicator`` exchanges through the Manager.

        No cross-node broadcast of the initial state: torchft's first quorum syncs the replicas (``init_sync``).
        With several ranks per replica group (``world_size`` > 1, the launch's default process group), group rank 0
        starts the group's TCPStore and broadcasts its port to the other ranks (collective over that group); every
        rank then runs its own Manager, which exchanges with the same group rank of every other replica group.

        Args:
            settings: The fault-tolerant mode's settings.
            model: The model copy (this rank's FSDP2 shards).
            optimizer: Its (replicating) optimizer.
            replicator: The optimizer's replicator, routed through the Manager (None: the runtime exchanges through
                ``replica.gather_bytes`` itself, e.g. MatFormer's per-region mean).
            device: This rank's device (``cuda``: NCCL, else gloo).
            owner: Class name used in logs.
            rank: This rank inside the replica group (the launch's rank).
            world_size: Ranks in the replica group (the launch's world size).
        """
        from lightning_hetero.ft.replicas import FaultTolerantReplica  # needs the ft extra: imported on use

        def build(store_port: int | None) -> FaultTolerantReplica:
            return FaultTolerantReplica(
                settings,
                model=model,
                optimizer=optimizer,
                extra_state=self.recovery_state,
                store_port=store_port,
                rank=rank,
                world_size=world_size,
                device=device,
            )

        if world_size == 1:
            self.replica = build(None)
        else:
            # The port travels over the launch's own group (ranks of one node, one host): no peer data, no pickle.
            port = torch.zeros(1, dtype=torch.int64, device=device)
            if rank == 0:
                self.replica = build(None)
                port.fill_(self.replica.store_port)
            comm.broadcast(port, src=0, label=comm.INTRA)
            if rank != 0:
                self.replica = build(int(port.item()))
        if replicator is not None:
            self.replica.manage(replicator)
        log.info(
            "%s: fault-tolerant mode, replica group %s, group rank %d of %d",
            owner,
            settings.resolve_replica_id(),
            rank,
            world_size,
        )

    def add_recovery_state(self, name: str, get: Callable[[], Any], set_state: Callable[[Any], None]) -> None:
        """Hand ``get()`` to a joining replica, which restores it with ``set_state``."""
        self.recovery_state[name] = (get, set_state)
        if self.replica is not None:
            self.replica.extra_state[name] = (get, set_state)

    def start_step(self) -> None:
        """Join this step's quorum once, before its first forward (a joiner is healed here).

        Raises:
            PeerPayloadError: The recovery checkpoint a live peer sent was refused.
        """
        if self.replica is not None and not self.step_open:
            self.replica.start_step()
            self.step_open = True

    def begin_batch(self) -> None:
        """A new batch was drawn for the next step: remember which (call before this batch's :meth:`start_step`)."""
        self.batch_step = self.committed_steps

    @property
    def overtaken(self) -> bool:
        """Whether the quorum committed this batch's step without this replica group: it was healed in place to a
        later step (frozen or cut off past the timeout), so the batch belongs to a step it missed."""
        return self.replica is not None and self.batch_step is not None and self.committed_steps > self.batch_step

    @property
    def committed_steps(self) -> int:
        """Steps the quorum committed (torchft's step; equal on every replica group that took part in the last step,
        a healed joiner included); 0 outside the mode."""
        return 0 if self.replica is None else int(self.replica.current_step())

    def committed_step(
        self, step: Callable[[], Any], *, retry: bool = False, abandon: Callable[[], Any] | None = None
    ) -> Any:
        """Run ``step`` (the optimizer step, closure included) and keep it only if the quorum commits it (weights,
        gradients and optimizer state are restored otherwise); outside the mode just run it. Returns what ``step``
        (or ``abandon``) returned.

        Args:
            step: Runs the optimizer step; with ``retry`` it must be repeatable (e.g. Lightning's closure, which runs
                forward and backward again on the same batch).
            retry: Run ``step`` again in a new quorum until it commits (a joiner or a lagging replica is healed in
                that quorum, before the step runs again), so one call is one committed step. torchft's
                ``max_retries`` (``FaultToleranceSettings.max_retries``) bounds the tries: past it, ``RuntimeError``.
            abandon: With :meth:`begin_batch` called for this batch: when the quorum turns out to have committed the
                batch's step without this replica group (:attr:`overtaken`: healed in place to a later step), run
                ``abandon`` instead of ``step`` (it must exchange nothing) and keep this quorum open for the next
                batch: the batch belongs to a step this group missed, so it is not trained, and the next one is the
                committed step's. :attr:`last_abandoned` says it happened; :attr:`last_commit` is False.
        """
        self.last_abandoned = False
        if self.replica is None:
            return step()
        output: list[Any] = [None]

        def run() -> None:
            output[0] = step()

        self.last_retries = 0
        while True:
            self.start_step()
            if abandon is not None and self.overtaken:
                self.last_commit = False
                self.last_abandoned = True
                self.abandoned_batches += 1
                log.warning(
                    "the quorum committed step %d without this replica group (healed in place to step %d): the batch "
                    "drawn for it is dropped, the next one is the committed step's",
                    (self.batch_step or 0) + 1,
                    self.committed_steps,
                )
                return abandon()
            try:
                self.last_commit = self.replica.step_optimizer(run)
            finally:
                self.step_open = False
            if self.last_commit or not retry:
                return output[0]
            self.last_retries += 1

    def metrics(self) -> dict[str, float]:
        """``ft/participants`` (replica groups in the last step's average), ``ft/committed`` (1 or 0),
        ``ft/retries`` (discarded tries before it), ``ft/step`` (committed steps, equal on every replica group) and
        ``ft/abandoned_batches`` (batches dropped because their step was committed without this group, in total)."""
        if self.replica is None or self.last_commit is None:
            return {}
        return {
            "ft/participants": float(self.replica.num_participants()),
            "ft/committed": float(self.last_commit),
            "ft/retries": float(self.last_retries),
            "ft/step": float(self.replica.current_step()),
            "ft/abandoned_batches": float(self.abandoned_batches),
        }

    def leave(self) -> None:
        """Leave the quorum (teardown); a later :meth:`join` starts again."""
        if self.replica is not None:
            self.replica.shutdown()
            self.replica = None
            self.step_open = False

    def checkpoint_state(self) -> dict[str, Any] | None:
        """torchft's committed step for a checkpoint (``{"torchft": manager.state_dict()}``), None outside the mode."""
        if self.replica is None:
            return None
        return {"torchft": {k: int(v) for k, v in self.replica.manager.state_dict().items()}}

    def load_checkpoint_state(self, entry: Any) -> None:
        """Restore the committed step saved by :meth:`checkpoint_state` (nothing else is saved there)."""
        if entry is not None and self.replica is not None and "torchft" in entry:
            saved = entry["torchft"]
            self.replica.manager.load_state_dict({key: int(saved[key]) for key in ("step", "batches_committed")})
