"""``MatFormerStrategy`` for the Lightning Trainer: tiered MatFormer data parallelism (Psyche-style heterogeneity).

Every rank trains the same model at its own FFN width: a tier-``t`` rank trains the first ``h >> t`` hidden units of
every FFN (or one width per FFN, Mix'n'Match). Gradients are averaged (or voted) per nested region among exactly the
ranks that hold it (:mod:`lightning_hetero.matformer.aggregate`), so a small rank moves only the bytes of what it
holds. With ``settings.slice_weights=True`` a small rank physically holds only its prefixes. Every setting is a field
of :class:`~lightning_hetero.matformer.settings.MatFormerSettings`.

How it plugs into the Trainer (narrow hooks of ``DDPStrategy``; there is no DDP wrapper because shapes differ):

- ``_configure_launcher`` (in ``Trainer(...)``): the tier list is checked against the world size and expanded.
- ``configure_ddp`` (in ``setup``, after ``configure_model`` and before the optimizers exist): schema check, rank 0's
  weights broadcast to every rank, with ``tiers: auto`` the measured choice of tiers (each rank times
  ``training_step`` on a sliced copy per candidate tier, on the first batch of the train dataloader), region process
  groups, then slicing (or masks).
- ``post_backward`` (inside the optimizer closure, before clipping and ``optimizer.step``): the per-region sync,
  skipped for the non-final micro-batches of gradient accumulation (``block_backward_sync``).
- ``load_model_state_dict`` / ``load_optimizer_state_dict``: rank 0's full checkpoint is cut to each rank's shapes.
- ``on_train_end``: every rank gets rank 0's full model back, so ``validate``/``test`` afterwards work as with DDP.

The fault-tolerant mode (``settings.fault_tolerance``, ``docs/spot.md``, "MatFormer nodes"): each launch is one node of
one rank, a torchft replica group holding the full (masked) model at its own tier. ``setup_optimizers`` joins the
quorum (LR schedulers and the Trainer's position travel with a heal), ``on_train_start`` / ``on_train_batch_start``
join each step's quorum before the forward (a joiner is healed there), ``post_backward`` averages per region over the
quorum's participants, and ``optimizer_step`` keeps a step only if the quorum commits it (else it runs again on the same
batch; a node healed in place past its batch's step drops that batch), so ``global_step`` counts committed steps;
``ft/*`` and ``comm/inter/bytes_sent_step`` are logged. With
``fault_tolerance.num_replica_groups`` the node reads its own shard of the training set.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_hetero import comm
from lightning_hetero.matformer.auto_tiers import ProbeStep
from lightning_hetero.matformer.layout import TierLayout
from lightning_hetero.matformer.runtime import MatFormerRuntime
from lightning_hetero.matformer.settings import DEFAULT_SETTINGS, MatFormerSettings
from lightning_hetero.strategies.batch_share import TrainerBatchShare
from lightning_hetero.strategies.lifecycle import TrainerStrategyBase
from lightning_hetero.strategies.metric_names import log_step_metrics
from lightning_hetero.strategies.quorum_gate import QuorumGatedHooks, TrainerQuorumGate
from lightning_hetero.strategies.replica_data import shard_train_loader

__all__ = ["TIER_LOSS_LABEL", "MatFormerStrategy"]

TIER_LOSS_LABEL = "metrics"
"""Ledger label of the per-tier loss all-reduce (``settings.log_tier_losses``), kept apart from the gradient bytes."""


class MatFormerStrategy(QuorumGatedHooks, TrainerStrategyBase[MatFormerSettings]):
    """Tiered MatFormer DDP for the Trainer: each rank trains its own FFN prefix of one shared model.

    Works on any LightningModule whose FFNs the adapter registry finds (an HF model anywhere in the module tree, built
    in ``__init__`` or in ``configure_model``). Global rank 0 must be tier 0: it holds the full model, which is what
    checkpoints and exports contain.

    Usage: ``MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1]))``; in YAML,
    ``strategy: {class_path: MatFormerStrategy, init_args: {settings: {tiers: [0, 1]}}}``.
    """

    settings_class = MatFormerSettings
    runtime_class = MatFormerRuntime

    def __init__(self, settings: MatFormerSettings = DEFAULT_SETTINGS, **kwargs: Any) -> None:
        """Takes a :class:`MatFormerSettings`; ``**kwargs`` are Lightning's arguments (see the base class)."""
        super().__init__(settings, **kwargs)
        self._batch_share = TrainerBatchShare(type(self).__name__)
        self._gate = TrainerQuorumGate(self.runtime.quorum)
        """The fault-tolerant mode's quorum-gated Lightning steps (no-ops outside it)."""
        self._dropping_batch = False
        """Fault-tolerant mode: the batch in flight is dropped (its step was committed without this node)."""

    # ------------------------------------------------------------------------------------------------ public
    @property
    def micro_batch_sizes(self) -> list[int] | None:
        """Every rank's micro-batch under ``settings.batch_share`` (once the train loader is built), else None."""
        return self._batch_share.sizes

    @property
    def tier(self) -> int | None:
        """This rank's tier (None for per-layer or non power-of-two widths); known from ``Trainer(...)`` on."""
        return self.runtime.tier_of(self.global_rank)

    @property
    def tiers(self) -> list[int | list[int]] | None:
        """Every global rank's entry (tier or width, per-node lists expanded), once the world size is known."""
        return self.runtime.per_rank

    @property
    def layout(self) -> TierLayout | None:
        """Every rank's width in every FFN (from ``setup`` on)."""
        return self.runtime.layout

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def configure_ddp(self) -> None:
        """Set up tiers instead of wrapping in DDP: runs before ``setup_optimizers``, so optimizers see the slices."""
        module = self.lightning_module
        assert module is not None
        self.runtime.auto_probe = self._probe_step(module)
        self.runtime.setup(module, self.root_device, self._global_step)
        report = self.runtime.auto_choice_report()
        if report is not None:
            rank_zero_info(report)
        if self.runtime.heterogeneous:
            scaler = getattr(self.precision_plugin, "scaler", None)
            if isinstance(self.precision_plugin, MixedPrecision) and scaler is not None:
                raise ValueError(
                    "MatFormerStrategy with mixed tiers cannot use precision='16-mixed': each rank's GradScaler would "
                    "skip steps on its own gradients and the shared weights would drift apart. Use 'bf16-mixed' or "
                    "'32-true'."
                )
            # Ranks hold different coordinates, so a local norm differs per rank; clip with the full model's norm.
            self._use_runtime_clipping()

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self.settings.fault_tolerance is None:
            return
        optimizer = self._only_optimizer("in the fault-tolerant mode a joining node is healed with one optimizer state")
        module = self.lightning_module
        assert module is not None
        self.runtime.join_quorum(module, optimizer, self.root_device)
        self._gate.attach(trainer, self.lr_scheduler_configs)

    def _probe_step(self, module: LightningModule) -> ProbeStep | None:
        """``tiers: auto``: ``training_step`` on the first batch of the train dataloader, run on a copy of ``module``
        that does not hold the Trainer (its ``self.log`` calls are then no-ops). None when there is nothing to probe.

        Raises:
            ValueError: The module optimizes manually (the probe runs its own backward and optimizer step).
        """
        if not self.settings.auto:
            return None
        trainer = module._trainer
        source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
        if trainer is None or source is None or not source.is_defined():
            return None
        if not module.automatic_optimization:
            raise ValueError(
                "MatFormerStrategy: settings.tiers='auto' probes training_step with its own backward and AdamW step, "
                "which needs automatic optimization; pass explicit tiers for a manually optimized module."
            )
        iterator = iter(CombinedLoader(source.dataloader(), "max_size_cycle"))
        try:
            batch = next(iterator)[0]
        except StopIteration:
            return None
        finally:
            del iterator
        batch = self.batch_to_device(batch, self.root_device)

        def copy_without_trainer(original: torch.nn.Module) -> torch.nn.Module:
            return copy.deepcopy(original, memo={id(trainer): None})

        def loss(candidate: torch.nn.Module) -> Tensor:
            output = candidate.training_step(batch, 0)  # type: ignore[operator]
            value = output.get("loss") if isinstance(output, Mapping) else output
            if not isinstance(value, Tensor):
                raise ValueError(
                    "MatFormerStrategy: settings.tiers='auto' probes training_step, which returned "
                    f"{type(output).__name__} with no loss tensor; return the loss (or a dict with 'loss'), or pass "
                    "explicit tiers."
                )
            return value

        return ProbeStep(loss=loss, copy=copy_without_trainer, context=self.precision_plugin.train_step_context)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """``settings.batch_share``: the train loader's micro-batches by speed, and every rank's micro-batch as its
        weight in each region's mean (``docs/batch_share.md``). Other loaders are left as they are."""
        dataloader = super().process_dataloader(dataloader)
        ft = self.settings.fault_tolerance
        if ft is not None and self._batch_share.applies(self):
            # Every node is its own launch: its shard of the one training set comes from its replica-group index.
            dataloader = shard_train_loader(dataloader, ft, group_rank=0, group_size=1, owner=self.runtime.owner)
        share = self.settings.batch_share
        if share is None or not self._batch_share.applies(self):
            return dataloader
        loader = self._batch_share.train_loader(self, dataloader, share)
        assert self._batch_share.sizes is not None
        self.runtime.rank_scale = [float(size) for size in self._batch_share.sizes]
        return loader

    # ------------------------------------------------------------------------------------------------ training
    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        module = self.lightning_module
        if self._sync_blocked or self._dropping_batch or module is None:
            return
        self.runtime.sync_gradients(module, self._global_step())

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self.settings.log_tier_losses:
            self._log_tier_losses(output)
        return output

    def _log_tier_losses(self, output: Any) -> None:
        """Log ``train/loss_tier{t}``: the mean loss of each tier's ranks, from one all-reduce (every rank joins)."""
        runtime, module = self.runtime, self.lightning_module
        assert module is not None and runtime.per_rank is not None
        keys = [_tier_key(runtime.tier_of(rank), rank) for rank in range(len(runtime.per_rank))]
        names = [f"{kind}{number}" for kind, number in sorted(set(keys), key=lambda k: (k[0] == "rank", k[1]))]
        keys = [f"{kind}{number}" for kind, number in keys]
        loss = output.get("loss") if isinstance(output, Mapping) else output
        totals = torch.zeros(2 * len(names), dtype=torch.float64, device=self.root_device)
        if isinstance(loss, Tensor):  # a skipped step (None) still joins the collective, with nothing to add
            index = names.index(keys[self.global_rank])
            totals[index] = loss.detach().double()
            totals[len(names) + index] = 1.0
        comm.all_reduce(totals, "sum", label=TIER_LOSS_LABEL)
        for index, name in enumerate(names):
            if totals[len(names) + index] > 0:
                value = (totals[index] / totals[len(names) + index]).float()
                module.log(f"train/loss_{name}", value, on_step=True, on_epoch=False, batch_size=1)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        quorum = self.runtime.quorum
        if not quorum.active:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        parent = super()
        sent_before = comm.get_ledger().totals(comm.INTER).sent
        # Kept only if the quorum commits it (the closure's backward runs the quorum's exchange, post_backward).
        output = self._gate.optimizer_step(
            lambda run: parent.optimizer_step(optimizer, run, model, **kwargs),
            closure,
            run_without_exchange=self._without_exchange,
        )
        # What this node handed to torchft's Manager for the step, discarded tries included (docs/metrics.md's name).
        metrics = {"comm/inter/bytes_sent_step": float(comm.get_ledger().totals(comm.INTER).sent - sent_before)}
        metrics.update(quorum.metrics())
        log_step_metrics(self.lightning_module, metrics)
        return output

    def _without_exchange(self, run: Callable[[], Any]) -> Any:
        """Run a dropped batch's closure: its backward must not exchange (``post_backward`` skips the sync)."""
        self._dropping_batch = True
        try:
            return run()
        finally:
            self._dropping_batch = False

    @override
    def on_train_end(self) -> None:
        module = self.lightning_module
        if module is not None:
            self.runtime.restore_full(module)

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        module.load_state_dict(self.runtime.slice_model_state(checkpoint["state_dict"]), strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        module = self.lightning_module
        assert module is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            optimizer.load_state_dict(self.runtime.slice_optimizer_state(state, optimizer, module))
            _optimizer_to_device(optimizer, self.root_device)


def _tier_key(tier: int | None, rank: int) -> tuple[str, int]:
    """Who a rank's loss is logged under: its tier, or the rank itself for per-layer widths."""
    return ("tier", tier) if tier is not None else ("rank", rank)
