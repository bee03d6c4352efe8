"""The loop-independent core of tiered MatFormer training, shared by the Trainer and Fabric strategies.

:class:`MatFormerRuntime` calls no Lightning API. It takes the validated
:class:`~lightning_hetero.matformer.settings.MatFormerSettings` and holds the per-node tier expansion, the collective
setup (schema check, broadcast of rank 0's initial weights, one process group per region rank set, slicing or
masking), the per-region gradient sync, tier-consistent norm clipping, checkpoint slicing and the return to one full
model after training. :mod:`lightning_hetero.strategies.matformer.trainer` (Trainer) and
:mod:`lightning_hetero.strategies.matformer.fabric` (Fabric) only decide *when* each piece runs.

A masked tier rank (``slice_weights=False``) trains only its neurons: a forward pre-hook on every FFN output
projection multiplies the FFN hidden activations by a 0/1 mask (its prefix, plus this step's helper draw while
training), cached per helper-draw window. On the checkpoint side, ``mode="demo"`` keeps every rank's error-feedback
buffers in rank 0's checkpoint, and sliced tier ranks load rank 0's full checkpoint cut to their FFN widths.

Every collective goes through :mod:`lightning_hetero.comm` with the label ``"inter"``.

With ``settings.fault_tolerance`` (the spot worker mode, ``docs/spot.md``) each launch is one node of ONE rank and one
torchft replica group holding the full (masked) model at its own node's tier (``node_entry``); the gradients are
averaged per region over the quorum's participants (:mod:`~lightning_hetero.matformer.ft_exchange`, through
``runtime.quorum``, a :class:`~lightning_hetero.ft.quorum_steps.QuorumSteps`) instead of region process groups.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_hetero import comm
from lightning_hetero.comm import INTER
from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.core import StrategyRuntime, WorldLayout, all_gather_json, broadcast_module_state
from lightning_hetero.ft.quorum_steps import QuorumSteps, check_fault_tolerant_world
from lightning_hetero.hetero.tier_choice import TierChoice
from lightning_hetero.matformer.adapters import FFNBlock, find_ffns
from lightning_hetero.matformer.aggregate import aggregate_gradients
from lightning_hetero.matformer.auto_tiers import ProbeStep, choose_auto_tiers, memory_limits
from lightning_hetero.matformer.checkpoint import grow_to_full, slice_model_state, slice_optimizer_state
from lightning_hetero.matformer.compressed import CHECKPOINT_KEY, CompressedExchange
from lightning_hetero.matformer.ft_exchange import GradientSpec, exchange_gradients, gradient_specs
from lightning_hetero.matformer.helper_ranks import HelperConfig, trained_neurons, validate_helpers
from lightning_hetero.matformer.layout import TierLayout, widths_for
from lightning_hetero.matformer.region_groups import RegionGroups
from lightning_hetero.matformer.schema import SETUP_DOCUMENT, agree_on_schema, canonical_hash, module_schema
from lightning_hetero.matformer.settings import MatFormerSettings, TierEntry, as_list, expand_entries, node_entry
from lightning_hetero.matformer.slicing import slice_model
from lightning_hetero.matformer.tiers import rank_weights
from lightning_hetero.matformer.types import FFNParameter
from lightning_hetero.replication.settings import ReplicationSettings

__all__ = ["MatFormerRuntime"]

log = logging.getLogger(__name__)


def _step_zero() -> int:
    """The step counter before ``setup`` gives the real one."""
    return 0


class MatFormerRuntime(StrategyRuntime):
    """The loop-independent part of tiered MatFormer training, shared by the Trainer and Fabric strategies.

    Args:
        settings: The strategy's settings (validated when they were built; see :class:`MatFormerSettings`).
        owner: Class name used in error messages.
    """

    checkpoint_key = CHECKPOINT_KEY  # mode="demo": every rank's error-feedback buffers, in rank 0's checkpoint

    settings: MatFormerSettings

    def __init__(self, settings: MatFormerSettings, owner: str = "MatFormerStrategy") -> None:
        self._attach_settings(settings, MatFormerSettings, owner)
        self.schema_hash: str | None = None
        """sha256 of the canonical tier-0 schema every rank agreed on at setup."""
        self.per_rank: list[TierEntry] | None = None
        """Every global rank's entry, once :meth:`resolve_world` ran (``tiers="auto"`` and the fault-tolerant mode:
        once :meth:`setup` ran)."""
        self.num_nodes = 1
        self.auto_choice: TierChoice | None = None
        """``tiers="auto"``: the measured choice (entries, reference step, one log line per rank), after setup."""
        self.auto_probe_seconds: float | None = None
        self.auto_probe: ProbeStep | None = None
        """``tiers="auto"``: how to run a training step on a copy, set by the adapter before :meth:`setup`."""
        """``tiers="auto"``: the slowest rank's probe wall time at setup (seconds)."""
        self.layout: TierLayout | None = None
        """Every rank's width in every FFN, once :meth:`setup` ran."""
        self.blocks: list[FFNBlock] = []
        self.ffn_params: list[FFNParameter] = []
        self.helpers: dict[int, HelperConfig] = {}
        self.groups: RegionGroups | None = None
        self.exchange: CompressedExchange | None = None
        """``mode="demo"``: the replicators and this rank's error-feedback buffers, once :meth:`setup` ran."""
        self._pending_exchange_state: dict[str, Tensor] | None = None
        self.local_widths: list[int] = []
        self.rank, self.world_size = 0, 1
        self.sliced = False
        self.step_fn: Callable[[], int] = _step_zero  # module-level: the runtime must pickle for spawn
        self._mask_handles: list[RemovableHandle] = []
        self._masks: dict[tuple[int, bool, int], Tensor] = {}
        self.rank_scale: list[float] | None = None
        """Batch share: every rank's micro-batch size, which multiplies its weight in each region's mean (the
        token-weighted mean, :mod:`lightning_hetero.hetero.batch_share`); None: every rank counts the same."""
        self.quorum = QuorumSteps()
        """The fault-tolerant mode's quorum-gated steps (joined by :meth:`join_quorum`; no-ops otherwise)."""
        self.ft_specs: list[GradientSpec] = []
        """The fault-tolerant mode: the wire order of the gradient payload (from :meth:`setup`)."""
        self.participant_widths: list[tuple[int, ...]] = []
        """The fault-tolerant mode: every participant's FFN widths in the last exchange (participant order)."""

    # ------------------------------------------------------------------------------------------------ world
    def resolve_world(self, world_size: int, num_nodes: int = 1) -> list[TierEntry]:
        """Expand the entries to one per global rank (per-node lists: node ``k`` holds ranks ``[kP, (k+1)P)``).

        With ``tiers="auto"`` there are no entries until :meth:`setup` measured every rank: this checks the
        ``auto_tiers.memory_limit_bytes`` override against the launch and returns an empty list.
        """
        self.num_nodes = num_nodes
        if self.settings.fault_tolerance is not None:
            # This node's entry needs its replica id (REPLICA_GROUP_ID), which only the launched process has: setup.
            self._check_one_rank(num_nodes, world_size)
            self.per_rank = None
            return []
        if self.settings.auto:
            memory_limits(self.owner, self.settings.auto_settings, world_size, num_nodes)
            self.per_rank = None
            return []
        self.per_rank = expand_entries(self.owner, self.settings, world_size, num_nodes)
        return self.per_rank

    def auto_choice_report(self) -> str | None:
        """``tiers="auto"``: what was chosen and why, one line per rank (after :meth:`setup`); None otherwise."""
        if self.auto_choice is None:
            return None
        return (
            f"{self.owner} tiers=auto chose {self.per_rank} (probe {self.auto_probe_seconds:.1f} s on the slowest "
            "rank):\n  " + "\n  ".join(self.auto_choice.lines)
        )

    def resolve_launch(self, world: WorldLayout) -> None:
        """Check the tier list against the launch (one entry per rank or per node; the spot mode: one rank)."""
        self.resolve_world(world.world_size, world.num_nodes)

    def _check_one_rank(self, nodes: int, ranks: int) -> None:
        """The fault-tolerant mode: one launch per node (``check_fault_tolerant_world``) and one rank per launch."""
        check_fault_tolerant_world(self.settings.fault_tolerance, self.owner, nodes, ranks)
        if ranks != 1:
            raise ValueError(
                f"{self.owner}(settings.fault_tolerance=...): this launch has {ranks} ranks, but in the fault-tolerant "
                "mode a MatFormer node is one replica group of ONE rank (its tier is its own, its full model is healed "
                "whole). Start one launch per rank with devices=1 (torchrun --nproc-per-node 1), each with its own "
                "REPLICA_GROUP_ID and its entry in settings.tiers; see docs/spot.md."
            )

    def tier_of(self, rank: int) -> int | None:
        """``rank``'s tier when it is one tier for every FFN, else (per-layer or non power-of-two widths) None."""
        if self.layout is not None:
            tiers = {self.layout.tier(rank, column) for column in self.layout.columns()}
            return tiers.pop() if len(tiers) == 1 else None
        if self.per_rank is None or self.settings.unit != "tier" or rank >= len(self.per_rank):
            return None
        values = set(as_list(self.per_rank[rank]))
        return values.pop() if len(values) == 1 else None

    @property
    def heterogeneous(self) -> bool:
        """Whether ranks hold different coordinates (different widths, or helpers)."""
        return self.layout is not None and (len(set(self.layout.widths)) > 1 or bool(self.helpers))

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self, module: nn.Module, device: torch.device, step_fn: Callable[[], int]) -> None:
        """Collective setup on every rank, before optimizers exist; raises on every rank before training.

        Checks that every rank can run (FFNs found, full width) and holds the same model (canonical schema), copies
        rank 0's parameters and buffers everywhere, (``tiers="auto"``) measures every rank's step and peak per
        candidate tier with :attr:`auto_probe` and chooses the tiers, builds the layout and the region groups, then
        slices this rank's FFNs (``slice_weights=True``) or installs its neuron masks.
        """
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        self.step_fn = step_fn
        if self.settings.fault_tolerance is not None:
            self._check_one_rank(1, self.world_size)  # torchrun's world, whatever the Trainer was told
            self.per_rank = [node_entry(self.owner, self.settings)]
        elif self.per_rank is None or len(self.per_rank) != self.world_size:
            self.resolve_world(self.world_size, self.num_nodes if self.world_size % self.num_nodes == 0 else 1)
        local_error: Exception | None = None
        payload: dict[str, Any] = {"error": None, "schema": None, "schema_hash": None}
        try:
            blocks = find_ffns(module)
            sliced = [b.path for b in blocks if b.width != b.full_size]
            if sliced:
                raise ValueError(
                    f"{self.owner} needs the full-width model at setup, but FFNs {sliced[:3]} are already sliced. "
                    "Pass a freshly built (or full-checkpoint) module."
                )
            payload["schema"] = module_schema(module)
            payload["schema_hash"] = canonical_hash(payload["schema"])
        except Exception as error:  # reported to every rank first, so that no rank waits for this one in a collective
            local_error, payload["error"] = error, f"{type(error).__name__}: {error}"
        gathered = all_gather_json(payload, self.world_size, device, schema=SETUP_DOCUMENT)
        if local_error is not None:
            raise local_error
        failed = {rank: entry["error"] for rank, entry in enumerate(gathered) if entry["error"]}
        if failed:
            raise RuntimeError(f"{self.owner} setup failed on rank(s) {sorted(failed)}: {failed}")
        self.schema_hash = agree_on_schema(gathered)
        if self.world_size > 1:
            broadcast_module_state(module, 0, label=INTER)
        self.blocks, self.ffn_params = blocks, [p for b in blocks for p in b.parameters]
        if self.settings.auto:
            self.auto_choice, self.auto_probe_seconds = choose_auto_tiers(
                self.owner,
                module,
                blocks,
                device,
                self.settings.auto_settings,
                self.auto_probe,
                self.rank,
                self.world_size,
                self.num_nodes if self.world_size % self.num_nodes == 0 else 1,
                # mode="demo" keeps an fp32 error-feedback buffer per trained parameter, which the probe does not
                extra_state_per_parameter_byte=1.0 if self.settings.mode == "demo" else 0.0,
            )
            self.per_rank = list(self.auto_choice.per_rank)
        self.layout = self._build_layout(blocks)
        self.helpers = self._build_helpers(self.layout)
        self.groups = RegionGroups(self.layout, helpers=self.helpers, label=INTER)
        if self.settings.mode == "demo":
            replication = self.settings.replication or ReplicationSettings()
            self.exchange = CompressedExchange(
                self.groups,
                replication.kept_fraction,
                chunk=replication.chunk,
                values=replication.values,
                index_bits=replication.index_bits,
                on_bad_payload=self.settings.on_bad_payload,
            )
            if self._pending_exchange_state is not None:
                self.exchange.load_state_dict(self._pending_exchange_state)
                self._pending_exchange_state = None
        self.local_widths = [self.layout.width(self.rank, b.layer) for b in blocks]
        if self.settings.fault_tolerance is not None:
            shapes = {name: tuple(p.shape) for name, p in module.named_parameters() if p.requires_grad}
            self.ft_specs = gradient_specs(shapes, self.ffn_params)
        if self.settings.slice_weights:
            if any(w != b.full_size for w, b in zip(self.local_widths, blocks, strict=True)):
                slice_model(module, widths=self.local_widths)
                self.sliced = True
        else:
            self._install_masks(module)

    def _build_layout(self, blocks: Sequence[FFNBlock]) -> TierLayout:
        unit = self.settings.unit
        name = "tiers" if unit == "tier" else "widths"
        assert self.per_rank is not None
        sizes = [b.full_size for b in blocks]
        per_layer = any(not isinstance(entry, int) for entry in self.per_rank)
        uniform = len(set(sizes)) == 1 and not per_layer
        try:
            layout = widths_for(
                self.per_rank,
                sizes[0] if uniform else sizes,
                num_layers=None if uniform else len(blocks),
                unit=unit,
            )
        except ValueError as error:
            raise ValueError(
                f"{self.owner}: settings.{name}={self.per_rank} does not fit the model's {len(blocks)} FFNs of "
                f"sizes {sorted(set(sizes))} (a per-layer entry needs one value per FFN): {error}"
            ) from None
        if layout.widths[0] != layout.full_sizes and self.settings.fault_tolerance is None:
            raise ValueError(
                f"{self.owner}: settings.{name}={self.per_rank}: global rank 0 must train the full width of every "
                f"FFN (sizes {list(layout.full_sizes)}), because it holds the model that is checkpointed and exported."
            )
        tier_weights = self.settings.tier_weights
        if tier_weights is not None:
            try:
                for layer in [None, *layout.columns()]:
                    rank_weights(layout, tier_weights, layer)
            except ValueError as error:
                raise ValueError(f"{self.owner}: settings.tier_weights={tier_weights}: {error}") from None
        return layout

    def _build_helpers(self, layout: TierLayout) -> dict[int, HelperConfig]:
        settings = self.settings
        if settings.helper_fraction == 0:
            return {}
        config = HelperConfig(settings.helper_fraction, settings.helper_seed, settings.helper_redraw_every)
        candidates = {rank: config for rank in range(layout.world_size) if layout.widths[rank] != layout.full_sizes}
        try:
            return validate_helpers(layout, candidates)
        except ValueError as error:
            raise ValueError(f"{self.owner}: settings.helper_fraction={settings.helper_fraction}: {error}") from None

    def join_quorum(self, module: nn.Module, optimizer: Optimizer, device: torch.device) -> None:
        """The fault-tolerant mode: join the torchft quorum as this node (after :meth:`setup`, with the optimizer).

        ``module`` and ``optimizer`` are what a joining node takes from a live peer (with the recovery state the
        adapter adds to :attr:`quorum`); the first quorum syncs nodes that start together.
        """
        ft = self.settings.fault_tolerance
        if ft is None:
            raise RuntimeError(f"{self.owner}: join_quorum needs settings.fault_tolerance.")
        if self.layout is None:
            raise RuntimeError(f"{self.owner}: set up the module before joining the quorum.")
        self.quorum.join(ft, model=module, optimizer=optimizer, replicator=None, device=device, owner=self.owner)

    def teardown(self) -> None:
        self.remove_masks()
        self.quorum.leave()

    # ----------------------------------------------------------------------------------------- neuron masks
    def _install_masks(self, module: nn.Module) -> None:
        for block in self.blocks:
            if self.local_widths[block.layer] == block.full_size:
                continue  # a full-width FFN trains every neuron (helpers only exist below full width)
            output = next(p for p in block.projections if p.role == "output")
            hook = partial(self._mask_input, block.layer)
            self._mask_handles.append(module.get_submodule(output.path).register_forward_pre_hook(hook))

    def _mask_input(self, layer: int, projection: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Forward pre-hook of an FFN output projection: zero the hidden units this rank does not train.

        The product zeroes both their contribution and every gradient through them. Training forwards use the
        prefix plus this step's helper draw; evaluation forwards use the prefix only (the tier's own model), except in
        the fault-tolerant mode, where every node holds the same full model and evaluates it whole.
        """
        hidden = args[0]
        training = projection.training
        if not training and self.settings.fault_tolerance is not None:
            return args  # every node holds the same full model: evaluate it whole, like rank 0 (TierEvaluation's tiers)
        step = self.step_fn() if training and self.helpers else 0
        key = (layer, training, step // self.settings.helper_redraw_every)
        mask = self._masks.get(key)
        if mask is None:
            assert self.layout is not None
            trained = trained_neurons(
                self.layout, self.rank, layer, helpers=self.helpers if training else None, step=step
            )
            mask = torch.zeros(self.layout.full_size_at(layer), device=hidden.device)
            mask[trained.to(hidden.device)] = 1.0
            self._masks = {k: v for k, v in self._masks.items() if k[1:] == key[1:]}  # keep only this window
            self._masks[key] = mask
        return (hidden * mask.to(hidden.dtype), *args[1:])

    def remove_masks(self) -> None:
        """Remove the neuron-mask hooks (the module then runs at full width)."""
        for handle in self._mask_handles:
            handle.remove()
        self._mask_handles, self._masks = [], {}

    # --------------------------------------------------------------------------------------------- training
    def sync_gradients(self, module: nn.Module, step: int) -> None:
        """Replace this rank's gradients by their per-region aggregate (collective; every rank, same order).

        Trainable parameters without a gradient get zeros, so that every rank sends the same tensors and applies
        the same update to shared parameters.
        """
        if self.groups is None:
            raise RuntimeError(f"{self.owner}: sync_gradients() before setup; set up the module first.")
        grads = {}
        for name, param in module.named_parameters():
            if param.requires_grad:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grads[name] = param.grad
        if self.settings.fault_tolerance is not None:
            self._sync_over_quorum(grads)
            return
        aggregate_gradients(
            grads,
            self.ffn_params,
            self.groups,
            self.settings.mode,
            self.settings.tier_weights,
            step=step,
            exchange=self.exchange,
            on_bad_payload=self.settings.on_bad_payload,
            rank_scale=self.rank_scale,
        )
        if self.exchange is not None:
            self.exchange.check_loaded_state_used()

    def _sync_over_quorum(self, grads: dict[str, Tensor]) -> None:
        """The fault-tolerant mode: the per-region mean over the quorum's participants (:mod:`.ft_exchange`).

        A refused peer payload fails this step's commit on every node (they all refuse the same authenticated bytes):
        the gradients stay as they are, nothing is applied, and the step is tried again in a new quorum.
        """
        replica = self.quorum.replica
        if replica is None:
            raise RuntimeError(f"{self.owner}: the fault-tolerant mode exchanges over the quorum; join it first.")
        full_sizes = [block.full_size for block in sorted(self.blocks, key=lambda b: b.layer)]
        try:
            self.participant_widths = exchange_gradients(
                replica.gather_bytes, self.local_widths, grads, self.ft_specs, full_sizes
            )
        except PeerPayloadError as error:
            log.warning("%s", error)
            replica.manager.report_error(error)

    def clip_grad_norm_(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """``clip_grad_norm_`` with one coefficient on every rank: the norm of the full model's gradient.

        Tier ranks hold different coordinates, so local norms differ and local clipping would let the shared weights
        drift apart. Rank 0 (tier 0) holds every coordinate with the aggregated values; its norm is broadcast.
        """
        params = [p for p in parameters if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, error_if_nonfinite)
        if self.heterogeneous and self.world_size > 1:
            comm.broadcast(norm, 0, label=INTER)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def restore_full(self, module: nn.Module) -> None:
        """Give every rank rank 0's full model (collective): grow sliced FFNs and broadcast their weights.

        Also refreshes the unused tails of masked tier ranks and removes the masks, so that evaluation after
        training sees one full model everywhere, as with DDP. Training cannot go on afterwards with the same
        optimizer (sliced parameters were replaced); it is meant for the end of training.
        """
        self.remove_masks()
        if self.world_size > 1 and self.heterogeneous:
            if self.sliced:
                grow_to_full(module, self.blocks)
                self.sliced = False
            params = dict(module.named_parameters())
            with torch.no_grad():
                for spec in self.ffn_params:
                    comm.broadcast(params[spec.name].data, 0, label=INTER)

    # ------------------------------------------------------------------------------------------ checkpoints
    def extra_checkpoint_state(self, device: torch.device) -> dict[str, Any] | None:
        """``mode="demo"``: every rank's error-feedback buffers, on rank 0 (collective; None elsewhere or off); the
        fault-tolerant mode: torchft's committed step."""
        if self.settings.fault_tolerance is not None:
            return self.quorum.checkpoint_state()
        if self.exchange is None:
            return None
        ranks = self.exchange.gather_state(device)
        return None if ranks is None else {"world_size": len(ranks), "ranks": ranks}

    def load_extra_checkpoint_state(self, entry: Mapping[str, Any] | None) -> None:
        """``mode="demo"``: restore this rank's buffers from a checkpoint entry (applied at setup if not set up yet).

        A checkpoint without the entry (saved in another mode) or from another world size resets them to zero, with
        a warning: training goes on, but not bit-identically.
        """
        if self.settings.fault_tolerance is not None:
            self.quorum.load_checkpoint_state(entry)
            return
        if self.settings.mode != "demo":
            return
        initialized = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if initialized else (1, 0)
        if entry is None or int(entry.get("world_size", -1)) != world:
            found = "no error-feedback buffers" if entry is None else f"buffers of {entry.get('world_size')} ranks"
            warnings.warn(
                f"{self.owner}(mode='demo'): the checkpoint holds {found} for this {world}-rank run; the"
                " error-feedback buffers start from zero (the resumed run is not bit-identical).",
                stacklevel=2,
            )
            state: dict[str, Tensor] = {}
        else:
            state = dict(entry["ranks"][rank])
        if self.exchange is None:
            self._pending_exchange_state = state
        else:
            self.exchange.load_state_dict(state)

    def slice_model_state(self, state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """A full model state dict cut to this rank's widths (unchanged when this rank is not sliced)."""
        return slice_model_state(state, self.ffn_params, self.local_widths) if self.sliced else state

    def slice_optimizer_state(self, state: Mapping[str, Any], optimizer: Optimizer, module: nn.Module) -> Any:
        """Rank 0's optimizer state cut to this rank's sliced parameters (unchanged when this rank is not sliced)."""
        return slice_optimizer_state(state, optimizer, module, self.ffn_params) if self.sliced else state
