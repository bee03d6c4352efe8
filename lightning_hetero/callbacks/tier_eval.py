"""Per-tier validation: :class:`TierEvaluation` logs ``val/loss_tier{t}`` and ``val/perplexity_tier{t}``.

Under a tiered strategy evaluation happens on global rank 0, which holds the full (tier-0) model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_hetero.callbacks.eval_report import mean_validation_loss
from lightning_hetero.callbacks.tier_common import (
    check_tiers_fit,
    default_tiers,
    is_tiered,
    runnable,
    strategy_tier,
    validate_limit,
    validate_tiers,
)
from lightning_hetero.matformer.adapters import find_ffns
from lightning_hetero.matformer.slicing import tier_view

__all__ = ["TierEvaluation"]


class TierEvaluation(Callback):
    """After every validation epoch, evaluate validation loss and perplexity of each tier and log them.

    Lightning's own validation loop has just run at full width (it logs ``val/loss``); this callback then runs the
    datamodule's validation loader once per tier under ``torch.no_grad()`` and ``tier_view(pl_module, tier)`` (in
    eval mode, in the precision plugin's forward context) and logs ``val/loss_tier{t}`` and
    ``val/perplexity_tier{t} = exp(val/loss_tier{t})``. The loss is ``forward(**batch).loss`` averaged over batches
    weighted by batch size, like the ``val/loss`` of our modules, so ``val/loss_tier0`` equals ``val/loss`` on the
    same batches. It is skipped during the sanity check. ``results`` holds the latest values, tier -> dict.

    Which batches: the first ``limit_batches`` of ``trainer.datamodule.val_dataloader()`` (of Lightning's validation
    loader when there is no datamodule). ``limit_batches=None`` uses the number of batches Lightning's validation
    loop used (``trainer.num_val_batches``, i.e. ``limit_val_batches``), which are the same batches on one process.

    Processes: with a tiered strategy (``trainer.strategy`` has a ``tier``), a rank at tier ``t`` can only run tiers
    ``>= t``, so only global rank 0 (tier 0, the full model) evaluates and logs, with ``rank_zero_only=True``; the
    other ranks skip. Do not monitor these metrics with ``ModelCheckpoint``/``EarlyStopping`` there (only rank 0 has
    them). With any other strategy every rank evaluates the whole (unsharded) loader, so sharded forwards work, and
    logs without syncing (the values are equal). A tier the local model can no longer run (sliced narrower) is
    skipped with a warning.

    Args:
        tiers: Tiers to evaluate. None: ``0..max``, the highest tier the FFN sizes divide into, capped at 3.
        limit_batches: Evaluate at most this many batches per tier (None: as many as Lightning's validation loop).
    """

    def __init__(self, tiers: list[int] | None = None, limit_batches: int | None = None) -> None:
        self.tiers = None if tiers is None else validate_tiers("TierEvaluation", tiers)
        validate_limit("TierEvaluation", limit_batches)
        self.limit_batches = limit_batches
        self.results: dict[int, dict[str, float]] = {}
        self._checked = False
        self._warned: set[int] = set()

    def resolve_tiers(self, pl_module: nn.Module) -> list[int]:
        """The tiers to evaluate for this model (``tiers``, or the default ``0..min(3, max)``)."""
        return list(self.tiers) if self.tiers is not None else default_tiers(pl_module)

    def _check(self, pl_module: LightningModule) -> None:
        if not self._checked and self.tiers is not None:
            check_tiers_fit("TierEvaluation", pl_module, self.tiers)
        self._checked = True

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not is_tiered(trainer) or trainer.global_rank == 0:
            self._check(pl_module)

    def _limit(self, trainer: Trainer) -> int | None:
        if self.limit_batches is not None:
            return self.limit_batches
        counts = trainer.num_val_batches
        if not counts or not math.isfinite(counts[0]):
            return None
        return int(counts[0])

    @staticmethod
    def _loader(trainer: Trainer) -> Iterable[Any]:
        datamodule = trainer.datamodule
        if datamodule is not None:
            return datamodule.val_dataloader()
        loaders = trainer.val_dataloaders
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if loaders else None
        if loaders is None:
            raise RuntimeError("TierEvaluation needs a validation loader: pass a datamodule or val_dataloaders.")
        return loaders

    def evaluate(self, trainer: Trainer, pl_module: LightningModule, tier: int, limit: int | None = None) -> float:
        """Mean validation loss of ``pl_module`` at ``tier`` over the first ``limit`` validation batches.

        Args:
            trainer: The Trainer (for the loader, the device transfer and the precision context).
            pl_module: The module; ``forward(**batch)`` must return an object with ``.loss``.
            tier: Tier to run.
            limit: Number of batches (None: all).
        """
        with tier_view(pl_module, tier):
            return mean_validation_loss(trainer, pl_module, self._loader(trainer), limit, "TierEvaluation")

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        tiered = is_tiered(trainer)
        if tiered and trainer.global_rank != 0:
            return  # only global rank 0 holds the full model, so only it can run every tier
        self._check(pl_module)
        blocks = find_ffns(pl_module)
        limit = self._limit(trainer)
        self.results = {}
        for tier in self.resolve_tiers(pl_module):
            if not runnable(blocks, tier):
                if tier not in self._warned:
                    self._warned.add(tier)
                    rank_zero_warn(
                        f"TierEvaluation: this process holds a model sliced narrower than tier {tier} (strategy tier "
                        f"{strategy_tier(trainer)}); skipping tier {tier}."
                    )
                continue
            loss = self.evaluate(trainer, pl_module, tier, limit)
            perplexity = math.exp(min(loss, 80.0))
            self.results[tier] = {"loss": loss, "perplexity": perplexity}
            for name, value in (("loss", loss), ("perplexity", perplexity)):
                pl_module.log(
                    f"val/{name}_tier{tier}",
                    value,
                    on_step=False,
                    on_epoch=True,
                    sync_dist=False,
                    rank_zero_only=tiered,
                    batch_size=1,
                )
