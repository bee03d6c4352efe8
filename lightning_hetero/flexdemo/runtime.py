"""The loop-independent core of the FlexDeMo strategies, shared by the Trainer and Fabric adapters.

:class:`FlexDeMoRuntime` calls no Lightning API. It takes a
:class:`~lightning_hetero.flexdemo.settings.FlexDeMoSettings` (validated when built, so a bad value fails when the
strategy is constructed), builds the ``(replicate, shard)`` mesh, shards the model copy with FSDP2 and broadcasts
the first replica's state, converts and binds the optimizer, installs the overlap hooks, clips with the node's
gradient norm, runs the drift guard and reports communication statistics. The adapters decide *when*.

With ``settings.fault_tolerance`` (the spot-worker mode, ``docs/spot.md``) each launch is one replica group: one model
copy, FSDP2-sharded over the launch's ranks. Each rank's replicator exchanges its own shard through a
:class:`~lightning_hetero.ft.replicas.FaultTolerantReplica` of its group rank (torchft's Manager, with the same group
rank of every other replica group, the mean over the replicas present this step) instead of a replicate process group,
and the adapters gate each optimizer step on the quorum's commit through ``runtime.quorum``
(:class:`~lightning_hetero.ft.quorum_steps.QuorumSteps`: ``start_step``, ``committed_step``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hetero import comm
from lightning_hetero.core import StrategyRuntime, WorldLayout, clip_grad_norm_over_group, process_rank_and_size
from lightning_hetero.core.drift import check_replica_drift
from lightning_hetero.flexdemo import checkpoint as ckpt
from lightning_hetero.flexdemo.conversion import convert_optimizer
from lightning_hetero.flexdemo.overlap import OverlapHooks
from lightning_hetero.flexdemo.replicating import ReplicatingOptimizer
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.flexdemo.sharding import (
    ShardingUnit,
    apply_activation_checkpointing,
    broadcast_initial_state,
    find_blocks,
    local_tensor,
    shard_model,
    sharding_units,
    warn_no_blocks,
)
from lightning_hetero.flexdemo.topology import Topology, build_topology, resolve_shard_size
from lightning_hetero.ft.quorum_steps import QuorumSteps, check_fault_tolerant_world
from lightning_hetero.replication import Replicator
from lightning_hetero.replication.settings import ReplicatorKind

__all__ = ["DEFAULT_REPLICATOR", "FlexDeMoRuntime"]

DEFAULT_REPLICATOR: ReplicatorKind = "demo"
"""The replicator used when none is given and the run has two or more model copies."""

log = logging.getLogger(__name__)


class FlexDeMoRuntime(StrategyRuntime):
    """Shared FlexDeMo logic: topology, sharding, optimizer binding, overlap, clipping, drift guard, statistics.

    Args:
        settings: The strategy's settings (validated when they were built; see :class:`FlexDeMoSettings`).
        owner: Class name used in messages.
    """

    directory_checkpoint = True  # each rank holds its own shards and error feedback
    restore_after_setup = True

    settings: FlexDeMoSettings

    def __init__(self, settings: FlexDeMoSettings, owner: str = "FlexDeMoStrategy") -> None:
        self._attach_settings(settings, FlexDeMoSettings, owner)
        # Any replication field set means the user asked for this exchange; all unset lets one copy skip compression.
        self.replicator_chosen = settings.replication.explicit
        self.default_kind: ReplicatorKind = DEFAULT_REPLICATOR
        """The kind built when ``settings.replication.kind`` is None (``"full"`` once one model copy is seen)."""
        self.replicator_note = ""
        """Why the default replicator was replaced (one model copy and none chosen), or empty."""
        self.compresses = bool(self.make_replicator().compresses)
        self.shard_size: int | None = None
        self.topology = Topology(world_size=1, rank=0, shard_size=1)
        self.sharded = False
        self.block_source = "none"
        self.units: list[ShardingUnit] = []
        self.module: nn.Module | None = None
        self.device = torch.device("cpu")
        self.optimizer: ReplicatingOptimizer | None = None
        self.conversion = ""
        """What happened to the user's optimizer (e.g. ``"AdamW converted to DecoupledAdamW (2 param group(s))"``)."""
        self.hooks: OverlapHooks | None = None
        self.overlap_active = False
        self.steps = 0
        """Optimizer steps completed (drives the drift guard)."""
        self._inter_sent_before = 0
        self._drift_due = False
        self.quorum = QuorumSteps()
        """The fault-tolerant mode's quorum-gated steps (joined in :meth:`prepare_optimizer`; no-ops otherwise)."""

    # ------------------------------------------------------------------------------------------------ config
    @property
    def replicator_name(self) -> str:
        """The replicator's kind: the one chosen, else the default for the run (``"demo"``, or ``"full"``)."""
        return self.settings.replication.kind or self.default_kind

    def make_replicator(self) -> Replicator:
        """A fresh replicator from the strategy's settings (one per converted optimizer)."""
        replicator = self.settings.replication.build(self.default_kind)
        replicator.set_bad_payload_policy(self.settings.on_bad_payload)
        return replicator

    def _use_dense_replicator(self) -> None:
        """One model copy and no replicator chosen: replicate with ``"full"`` (the update is the optimizer's own)."""
        self.default_kind = "full"
        self.compresses = False
        self.replicator_note = (
            f"a single model copy ({self.topology.world_size} rank(s), shard_size={self.topology.shard_size}) and no "
            "replicator chosen: using replicator='full' (no compression; nothing crosses nodes). Set "
            "settings.replication.kind='demo' to compress anyway"
        )
        log.info("%s: %s.", self.owner, self.replicator_note)

    def resolve_world(self, world_size: int, ranks_per_node: int) -> int:
        """Check ``shard_size`` against the launch layout (before processes start); returns the shard size."""
        self.shard_size = resolve_shard_size(self.settings.shard_size, world_size, ranks_per_node, self.owner)
        return self.shard_size

    def resolve_launch(self, world: WorldLayout) -> None:
        """Check ``shard_size`` against the ranks per node of the launch (and the fault-tolerant mode's layout)."""
        check_fault_tolerant_world(self.settings.fault_tolerance, self.owner, world.num_nodes, world.ranks_per_node)
        self.resolve_world(world.world_size, world.ranks_per_node)
        check_fault_tolerant_world(self.settings.fault_tolerance, self.owner, 1, world.ranks_per_node, self.shard_size)

    # ------------------------------------------------------------------------------------------------ setup
    def setup_module(self, module: nn.Module, device: torch.device, param_dtype: torch.dtype | None = None) -> None:
        """Build the mesh, shard ``module`` in place and broadcast the first replica's state (collective).

        Args:
            module: The model copy (a LightningModule or any ``nn.Module``), already on ``device``.
            device: This rank's device.
            param_dtype: Compute dtype of the gathered parameters (bf16 under ``bf16-mixed``); None keeps fp32.
        """
        if self.module is not None:
            raise RuntimeError(f"{self.owner} shards one model; setup was already called.")
        _, world_size = process_rank_and_size()
        # torchrun's world, whatever the Trainer was told
        check_fault_tolerant_world(self.settings.fault_tolerance, self.owner, 1, world_size)
        if self.shard_size is None or world_size % self.shard_size:
            self.resolve_world(world_size, world_size)
        assert self.shard_size is not None
        check_fault_tolerant_world(self.settings.fault_tolerance, self.owner, 1, world_size, self.shard_size)
        self.topology = build_topology(device, self.shard_size)
        self.device = device
        # Fault-tolerant mode: the model copies are the replica groups behind the lighthouse, not this launch's ranks.
        single_copy = self.topology.num_replicas == 1 and self.settings.fault_tolerance is None
        if single_copy and self.compresses and not self.replicator_chosen:
            self._use_dense_replicator()
        if single_copy and self.compresses:
            warnings.warn(
                f"{self.owner}(replication.kind={self.replicator_name!r}): the run has a single model copy "
                f"({self.topology.world_size} rank(s), shard_size={self.topology.shard_size}), so nothing crosses "
                "nodes and the replicator's compression only loses information (the update is computed as if alone)."
                " Use more nodes, a smaller settings.shard_size, or settings.replication.kind='full'.",
                UserWarning,
                stacklevel=2,
            )
        classes = self.settings.block_classes
        blocks, self.block_source = find_blocks(module, list(classes) if classes is not None else None)
        if not blocks:
            warn_no_blocks(self.owner, module)
        if self.settings.activation_checkpointing:
            apply_activation_checkpointing(block for _, block in blocks)
        self.sharded = shard_model(module, self.topology, [block for _, block in blocks], param_dtype)
        broadcast_initial_state(module, self.topology)
        self.units = sharding_units(module, blocks)
        self.module = module
        log.info(
            "%s: %d replica(s) x shard_size %d, %d block(s) found by %s, sharded=%s",
            self.owner,
            self.topology.num_replicas,
            self.topology.shard_size,
            len(blocks),
            self.block_source,
            self.sharded,
        )

    def prepare_optimizer(self, optimizer: Optimizer, overlap: bool | None = None) -> ReplicatingOptimizer:
        """Convert (or keep) ``optimizer``, bind it to the replicate group and install the overlap hooks.

        Args:
            optimizer: Built on the sharded parameters.
            overlap: Override of ``settings.overlap`` (the adapters turn it off when clipping must see the gradients).
        """
        if self.module is None:
            raise RuntimeError(f"{self.owner}: set up the module before the optimizer.")
        if self.optimizer is not None:
            raise ValueError(f"{self.owner} supports exactly one optimizer (FlexDeMo replicates one update).")
        converted, self.conversion = convert_optimizer(
            optimizer,
            self.make_replicator,
            self.owner,
            adamw_exchange=self.settings.adamw_exchange,
            preconditioner_beta2=self.settings.preconditioner_beta2,
        )
        converted.replicator.set_bad_payload_policy(self.settings.on_bad_payload)  # also a user-built replicator
        self.overlap_active = self.settings.overlap if overlap is None else bool(overlap)
        if self.settings.fault_tolerance is not None:
            self._start_replica(converted)
            # Exchanges through the Manager are synchronous (nothing to hide), and an exchange launched during
            # backward would update error feedback before the step's state copy could be taken (Fabric).
            self.overlap_active = False
        else:
            converted.bind(self.topology.replicate_group)
        self.optimizer = converted
        owned = {id(p) for group in converted.param_groups for p in group["params"]}
        units = [ShardingUnit(u.name, [p for p in u.params if id(p) in owned]) for u in self.units]
        if self.overlap_active:
            self.hooks = OverlapHooks(units, converted)
        return converted

    def _start_replica(self, optimizer: ReplicatingOptimizer) -> None:
        """Join the torchft quorum; the replicator exchanges through the Manager from now on."""
        assert self.module is not None and self.settings.fault_tolerance is not None
        optimizer.bind(None)  # no replicate process group: the Manager's group changes with every quorum
        self.quorum.join(
            self.settings.fault_tolerance,
            model=self.module,
            optimizer=optimizer,
            replicator=optimizer.replicator,
            device=self.device,
            owner=self.owner,
            rank=self.topology.rank,
            world_size=self.topology.world_size,
        )

    # ------------------------------------------------------------------------------------------------ training
    def set_sync_blocked(self, blocked: bool) -> None:
        """Accumulation micro-batches launch no exchange; the final backward does."""
        self.arm(not blocked)

    def arm(self, final_micro_batch: bool) -> None:
        """Whether the coming backward is the last before ``optimizer.step()`` (only then do hooks launch)."""
        if self.hooks is not None:
            self.hooks.armed = final_micro_batch

    @property
    def launched_early(self) -> bool:
        """Whether some exchange of the current step already started during backward."""
        return self.hooks is not None and self.hooks.launched_any

    def before_step(self) -> None:
        """Remember the ledger position so that :meth:`after_step` reports this step's inter-node bytes."""
        self._inter_sent_before = comm.get_ledger().totals(comm.INTER).sent

    def after_step(self) -> dict[str, float]:
        """Bookkeeping after ``optimizer.step()``: re-arm the hooks, run the drift guard when due, return metrics."""
        self.steps += 1
        if self.hooks is not None:
            self.hooks.armed = True
        every = self.settings.drift_check_every
        if every and self.steps % every == 0:
            self._drift_due = True
        if self._drift_due and self._replicas_in_sync():
            self._drift_due = False
            self.check_drift()
        return self.comm_metrics()

    def _replicas_in_sync(self) -> bool:
        """Whether the replicas must be identical now (DiLoCo: only right after a synchronising step)."""
        replicator = getattr(self.optimizer, "replicator", None)
        syncs_at = getattr(replicator, "syncs_at", None)
        return syncs_at is None or bool(syncs_at(replicator.step - 1))

    def comm_metrics(self) -> dict[str, float]:
        """``comm/*`` metrics of the last step (docs/metrics.md): ``comm/inter/bytes_sent_step``, the ``"inter"``
        bytes this rank sent during the optimizer step (in the fault-tolerant mode what this replica handed to
        torchft's Manager, retried tries included; the name and meaning of :class:`CommunicationMonitor`'s metric),
        launched-early count, ``wait_seconds`` (blocked waiting), ``comm_seconds`` (wall-clock time with an exchange
        in flight: the union of the buckets' spans, never more than the step), the replicator's encode/decode
        seconds (its compute: DCT, top-k, packing), and ``comm/hidden_fraction`` = 1 - wait / comm (the share of the
        exchange's duration overlapped with work; 0 when nothing overlaps, as in the synchronous fault-tolerant
        exchange)."""
        sent = comm.get_ledger().totals(comm.INTER).sent - self._inter_sent_before
        metrics = {"comm/inter/bytes_sent_step": float(sent)}
        stats = self.optimizer.comm_stats() if self.optimizer is not None else {}
        for key in ("launched_early", "wait_seconds", "comm_seconds", "encode_seconds", "decode_seconds"):
            if key in stats and isinstance(stats[key], (int, float)):
                metrics[f"comm/{key}"] = float(stats[key])
        comm_seconds, wait_seconds = stats.get("comm_seconds"), stats.get("wait_seconds")
        if isinstance(comm_seconds, (int, float)) and isinstance(wait_seconds, (int, float)) and comm_seconds > 0:
            metrics["comm/hidden_fraction"] = min(1.0, max(0.0, 1.0 - wait_seconds / comm_seconds))
        return metrics

    def check_drift(self) -> None:
        """Run the replica drift guard now (collective over the world)."""
        if self.module is not None:
            check_replica_drift(
                list(self.module.named_parameters()),
                self.steps,
                owner="FlexDeMo",
                num_replicas=self.topology.num_replicas,
                replicate_group=self.topology.replicate_group,
                shard_size=self.topology.shard_size,
            )

    @torch.no_grad()
    def clip_grad_norm_(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the local gradients by the norm of the node's (the model copy's) gradient, before momentum.

        The norm is taken over the gradient shards of this copy: one scalar all-reduce inside the shard group
        (label ``"intra"``), none across nodes. Replicas may clip by different factors; that is the definition.

        Raises:
            RuntimeError: part of this step's exchange was already launched from the unclipped gradients.
        """
        if self.launched_early:
            raise RuntimeError(
                f"{self.owner}: gradient clipping after the overlapped exchange already started from the unclipped "
                f"gradients. Construct {self.owner}(settings=FlexDeMoSettings(overlap=False)) to clip (the Trainer "
                "does this by itself when gradient_clip_val is set)."
            )
        grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
        group = self.topology.shard_group
        reduce = group is not None
        return clip_grad_norm_over_group(
            grads, max_norm, norm_type, group, comm.INTRA, error_if_nonfinite, reduce=reduce, owner=self.owner
        )

    def teardown(self) -> None:
        """Remove the hooks and forget the optimizer (the sharded module stays; a later fit binds a new optimizer);
        the fault-tolerant mode leaves the quorum."""
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        self.quorum.leave()
        self.optimizer = None

    # ------------------------------------------------------------------------------------------------ checkpoints
    def extra_checkpoint_state(self, device: torch.device) -> dict[str, Any] | None:
        """Fault-tolerant mode: torchft's committed step (``{"torchft": manager.state_dict()}``)."""
        return self.quorum.checkpoint_state()

    def load_extra_checkpoint_state(self, entry: Any) -> None:
        """Restore the committed step saved by :meth:`extra_checkpoint_state` (nothing else is saved there)."""
        self.quorum.load_checkpoint_state(entry)

    def checkpoint_part(self, global_rank: int) -> str:
        return ckpt.rank_file(".", global_rank).stem

    def checkpoint_part_to_load(self, global_rank: int) -> str:
        return ckpt.rank_file(".", global_rank).stem

    def write_checkpoint_meta(self, directory: Path) -> None:
        if self.module is not None:
            ckpt.write_meta(directory, self.module, self.topology)

    def check_checkpoint_meta(self, directory: Path) -> None:
        ckpt.read_meta(directory, self.topology, self.owner)

    def load_checkpoint_part(self, directory: Path, global_rank: int, map_location: Any = "cpu") -> dict[str, Any]:
        """This rank's part; a checkpoint of another layout (world size, shard size) is re-cut for this one."""
        params = [] if self.optimizer is None else [p for g in self.optimizer.param_groups for p in g["params"]]
        return ckpt.load_rank_part(directory, self.topology, self.module, params, self.owner, map_location)
