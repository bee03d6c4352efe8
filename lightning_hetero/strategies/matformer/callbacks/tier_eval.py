"""Per-tier validation: :class:`TierEvaluation` logs ``val/loss_tier{t}`` and ``val/perplexity_tier{t}``.

It evaluates through the module's own ``validation_step`` (see :mod:`~lightning_hetero.callbacks.eval_report`).
Under a tiered strategy evaluation happens on global rank 0, which holds the full (tier-0) model.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hetero import comm
from lightning_hetero.callbacks.eval_report import (
    check_evaluable,
    mean_validation_loss,
    validate_metric,
    validation_loader,
)
from lightning_hetero.matformer.adapters import find_ffns
from lightning_hetero.matformer.slicing import tier_view
from lightning_hetero.strategies.matformer.callbacks.tier_common import (
    check_tiers_fit,
    is_tiered,
    runnable,
    strategy_tier,
    validate_limit,
    validate_tiers,
)
from lightning_hetero.strategies.matformer.callbacks.tier_source import callback_tiers

__all__ = ["METRICS_LABEL", "TierEvaluation"]

METRICS_LABEL = "metrics"
"""Ledger label of rank 0's per-tier values sent to the other ranks (a metric, kept apart from gradient bytes)."""


class TierEvaluation(Callback):
    """After every validation epoch, evaluate the validation loss of each tier and log it, with its perplexity.

    Lightning's own validation loop has just run at full width; this callback then runs the validation loader once
    per tier under ``torch.no_grad()`` and ``tier_view(pl_module, tier)`` (in eval mode, in the precision plugin's
    validation context), through the module's own ``validation_step`` (or its ``validation_loss(batch)`` hook; see
    :func:`~lightning_hetero.callbacks.eval_report.mean_validation_loss` for what is read, and how our batches stay
    out of the module's logged metrics). It logs ``val/loss_tier{t}`` (``{metric}_tier{t}`` with ``metric``) and
    ``val/perplexity_tier{t} = exp(value)``. The value is averaged over batches weighted by batch size, like the
    ``val/loss`` of our modules, so ``val/loss_tier0`` equals the module's validation loss on the same batches. It
    is skipped during the sanity check. ``results`` holds the latest values, tier -> dict. A module with neither
    ``validation_step`` nor the hook fails in ``setup``; one whose value cannot be read (e.g. a ``metric`` it never
    logs) fails when fit starts, on one probe batch: both before the first training step.

    Which batches: those of the loader Lightning's validation loop uses (the datamodule's, the module's own
    ``val_dataloader``, or ``fit(val_dataloaders=...)``), unsharded. ``limit_batches=None`` evaluates as many batches
    as Lightning's validation loop used (``trainer.num_val_batches``, i.e. ``limit_val_batches``). When that is fewer
    than the loader has, a plain ``DataLoader`` in storage order is read in a fixed seeded order, so the batches are a
    fair sample, the same for every tier and every epoch (our DataModules' loaders are in such an order already,
    and then these are the batches Lightning's loop used, on one process).

    Processes: with a tiered strategy (``trainer.strategy`` has a ``tier``), a rank at tier ``t`` can only run tiers
    ``>= t``, so only global rank 0 (tier 0, the full model) evaluates; it broadcasts its values (one float64 per tier,
    ledger label ``"metrics"``) and every rank logs them. With any other strategy every rank evaluates the whole
    (unsharded) loader, so sharded forwards work. Either way every rank logs the same values with ``sync_dist=True``
    (the mean over ranks is the value itself), so ``ModelCheckpoint``/``EarlyStopping`` may monitor them on any rank.
    A tier the local model can no longer run (sliced narrower) is skipped with a warning.

    These are not Lightning's ``val_loss``/``val/loss`` (docs/metrics.md): that one is the mean over ranks of each
    rank's shard of the loader at the width the rank trains (under MatFormer, a mix of tiers), while
    ``val/loss_tier{t}`` is the whole loader (or its fair sample) at tier ``t``.

    Args:
        tiers: Tiers to evaluate. None: the tiers the run trains, read at setup: ``MatFormerStrategy``'s
            ``settings.tiers`` (given tiers must include them there), else a ``MatFormerSampler``'s tiers (with neither,
            pass them). The tiers used are in ``resolved_tiers``.
        limit_batches: Evaluate at most this many batches per tier (None: as many as Lightning's validation loop).
        metric: Name ``validation_step`` logs (or returns in a dict) to evaluate per tier. None: the loss it returns,
            else the value it logs as ``val_loss`` or ``val/loss``.
        perplexity: Also log ``val/perplexity_tier{t}`` (set False for metrics that are not a log-likelihood).
    """

    def __init__(
        self,
        tiers: list[int] | None = None,
        limit_batches: int | None = None,
        metric: str | None = None,
        perplexity: bool = True,
    ) -> None:
        self.tiers = None if tiers is None else validate_tiers("TierEvaluation", tiers)
        self.resolved_tiers: list[int] | None = None
        """The tiers evaluated in this fit (``tiers``, or the run's), from ``setup`` on."""
        validate_limit("TierEvaluation", limit_batches)
        self.limit_batches = limit_batches
        self.metric = validate_metric("TierEvaluation", metric)
        self.perplexity = perplexity
        self.results: dict[int, dict[str, float]] = {}
        self._checked = False
        self._warned: set[int] = set()

    def resolve_tiers(self, trainer: Trainer) -> list[int]:
        """The tiers to evaluate in this run (``tiers``, or the run's; see :func:`callback_tiers`)."""
        self.resolved_tiers = callback_tiers("TierEvaluation", self.tiers, trainer)
        return list(self.resolved_tiers)

    def _check(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._checked:
            tiers = self.resolved_tiers if self.resolved_tiers is not None else self.resolve_tiers(trainer)
            check_tiers_fit("TierEvaluation", pl_module, tiers)
        self._checked = True

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # On every rank (the module is the same everywhere), so a bad module stops all ranks before the first step.
        if stage in ("fit", "validate"):
            check_evaluable("TierEvaluation", pl_module, self.metric)
            self.resolve_tiers(trainer)
            self._checked = False

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.resolve_tiers(trainer)  # again: with tiers: auto the strategy chose them in between (at its setup)
        if not is_tiered(trainer) or trainer.global_rank == 0:
            self._check(trainer, pl_module)
        self._probe(trainer, pl_module)

    def _probe(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Read the value of one validation batch now, so a module we cannot evaluate fails before training.

        Every rank runs it at the width it holds, the same way on all ranks, so a failure stops every rank here
        (nothing is logged, no collective is started). Skipped when validation is off (``limit_val_batches=0``).
        """
        if trainer.limit_val_batches == 0:
            return
        loader = validation_loader(trainer, pl_module, "TierEvaluation")
        mean_validation_loss(trainer, pl_module, loader, 1, "TierEvaluation", metric=self.metric)

    def _limit(self, trainer: Trainer) -> int | None:
        if self.limit_batches is not None:
            return self.limit_batches
        counts = trainer.num_val_batches
        if not counts or not math.isfinite(counts[0]):
            return None
        return int(counts[0])

    def evaluate(self, trainer: Trainer, pl_module: LightningModule, tier: int, limit: int | None = None) -> float:
        """Mean validation value of ``pl_module`` at ``tier`` over ``limit`` validation batches.

        Args:
            trainer: The Trainer (for the loader, the device transfer and the precision context).
            pl_module: The module; it needs ``validation_step`` or the ``validation_loss(batch)`` hook.
            tier: Tier to run.
            limit: Number of batches (None: all); a fair sample when fewer than the loader has.
        """
        loader = validation_loader(trainer, pl_module, "TierEvaluation")
        with tier_view(pl_module, tier):
            return mean_validation_loss(trainer, pl_module, loader, limit, "TierEvaluation", metric=self.metric)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        tiered = is_tiered(trainer)
        tiers = self.resolved_tiers if self.resolved_tiers is not None else self.resolve_tiers(trainer)
        # Only global rank 0 holds the full model under a tiered strategy, so only it can run every tier.
        losses = self._evaluate_tiers(trainer, pl_module) if not tiered or trainer.global_rank == 0 else {}
        if tiered and trainer.world_size > 1:
            losses = _from_rank_zero(losses, tiers, trainer.strategy.root_device)
        self.results = {}
        for tier, loss in losses.items():
            self.results[tier] = {"loss": loss}
            names = {"loss": f"val/loss_tier{tier}" if self.metric is None else f"{self.metric}_tier{tier}"}
            if self.perplexity:
                self.results[tier]["perplexity"] = math.exp(min(loss, 80.0))
                names["perplexity"] = f"val/perplexity_tier{tier}"
            for key, value in self.results[tier].items():
                # Every rank holds the same value here, so the epoch-level mean over ranks is that value (and
                # ModelCheckpoint/EarlyStopping see the same number on every rank).
                pl_module.log(names[key], value, on_step=False, on_epoch=True, sync_dist=True, batch_size=1)

    def _evaluate_tiers(self, trainer: Trainer, pl_module: LightningModule) -> dict[int, float]:
        """Each resolved tier's mean validation value, for the tiers this process can run."""
        self._check(trainer, pl_module)
        blocks = find_ffns(pl_module)
        limit = self._limit(trainer)
        losses: dict[int, float] = {}
        assert self.resolved_tiers is not None  # set by _check
        for tier in self.resolved_tiers:
            if not runnable(blocks, tier):
                if tier not in self._warned:
                    self._warned.add(tier)
                    rank_zero_warn(
                        f"TierEvaluation: this process holds a model sliced narrower than tier {tier} (strategy tier "
                        f"{strategy_tier(trainer)}); skipping tier {tier}."
                    )
                continue
            losses[tier] = self.evaluate(trainer, pl_module, tier, limit)
        return losses


def _from_rank_zero(losses: dict[int, float], tiers: list[int], device: torch.device) -> dict[int, float]:
    """Global rank 0's ``{tier: loss}`` on every rank: one float64 broadcast (NaN: a tier rank 0 skipped)."""
    values = torch.tensor([losses.get(tier, math.nan) for tier in tiers], dtype=torch.float64, device=device)
    comm.broadcast(values, 0, label=METRICS_LABEL)
    return {tier: float(value) for tier, value in zip(tiers, values.tolist(), strict=True) if not math.isnan(value)}
