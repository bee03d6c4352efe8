"""Where ``TierEvaluation`` and ``TierExport`` get their tiers when not given: the run's, so a YAML writes them once.

The tiers a run trains are ``MatFormerStrategy``'s ``settings.tiers`` (with ``tiers: auto``, the tiers it chose at
setup, and before that its candidate tiers), or, under any other strategy, a ``MatFormerSampler``'s (it sits among the
callbacks).
"""

from __future__ import annotations

from lightning.pytorch import Trainer

from lightning_hetero.matformer.settings import MatFormerSettings
from lightning_hetero.strategies.matformer.callbacks.tier_sampler import MatFormerSampler

__all__ = ["callback_tiers"]


def callback_tiers(owner: str, given: list[int] | None, trainer: Trainer) -> list[int]:
    """The tiers a callback works on: ``given``, or the ones the run trains, so that a YAML writes them once.

    Under ``MatFormerStrategy``: its ``settings.tiers`` (the distinct tiers, sorted; no tiers at all means ``[0]``);
    ``given`` tiers must include every one of them (and may add more). Under another strategy: ``given``, else the
    tiers of a ``MatFormerSampler`` among the callbacks.

    Raises:
        ValueError: ``given`` leaves out a tier the strategy trains; or no tiers are given and the run names none
            (another strategy without a sampler, or a MatFormer strategy with ``widths`` or per-FFN tiers).
    """
    settings = getattr(trainer.strategy, "settings", None)
    if isinstance(settings, MatFormerSettings) and settings.auto:
        return _auto_tiers(owner, given, settings, getattr(trainer.strategy, "tiers", None))
    if isinstance(settings, MatFormerSettings):
        trained = settings.uniform_tiers
        if trained is None:
            if given is not None:
                return list(given)  # widths or per-FFN tiers name no single tier to compare with
            which = f"widths={settings.widths}" if settings.widths is not None else f"tiers={settings.tiers}"
            raise ValueError(
                f"{owner}: the strategy's MatFormerSettings.{which} gives some rank per-FFN tiers or widths, which "
                f"name no single tier to evaluate or export; pass {owner}(tiers=[...]), e.g. tiers=[0, 1]."
            )
        missing = [tier for tier in trained if given is not None and tier not in given]
        if missing:
            # Extra tiers are fine (rank 0 holds the full model, so it runs any tier, e.g. an untrained-for
            # reference slice); leaving out a trained tier is what a tier list edited in one place only looks like.
            raise ValueError(
                f"{owner}(tiers={given}) differs from the tiers the strategy trains (MatFormerSettings.tiers="
                f"{settings.tiers}, i.e. tiers {trained}): it leaves out tier(s) {missing}. Leave {owner}'s tiers out "
                "to use the strategy's, or include every tier the strategy trains."
            )
        return list(given) if given is not None else trained
    if given is not None:
        return list(given)
    samplers = [callback for callback in trainer.callbacks if isinstance(callback, MatFormerSampler)]
    if samplers:
        return list(samplers[0].tiers)
    raise ValueError(
        f"{owner}: no tiers given, and {type(trainer.strategy).__name__} is not MatFormerStrategy (whose "
        f"settings.tiers would be read) and no MatFormerSampler trains tiers here; pass {owner}(tiers=[0, 1, 2, 3]) "
        "(tier t keeps h >> t FFN units)."
    )


def _auto_tiers(owner: str, given: list[int] | None, settings: MatFormerSettings, chosen: list | None) -> list[int]:
    """``tiers: auto``: before setup chose, ``given`` or every candidate tier (rank 0 holds the full model, so it runs
    any of them); after, ``given`` (which must include every chosen tier) or the chosen tiers."""
    if chosen is None:
        return list(given) if given is not None else list(settings.auto_settings.candidates)
    if any(not isinstance(entry, int) for entry in chosen):
        if given is not None:
            return list(given)
        raise ValueError(
            f"{owner}: MatFormerSettings.tiers='auto' chose per-FFN tiers {chosen} (auto_tiers.mix_layers), which name "
            f"no single tier to evaluate or export; pass {owner}(tiers=[...]), e.g. tiers=[0, 1]."
        )
    trained = sorted(set(chosen))
    missing = [tier for tier in trained if given is not None and tier not in given]
    if missing:
        raise ValueError(
            f"{owner}(tiers={given}) leaves out tier(s) {missing}, which MatFormerSettings.tiers='auto' chose "
            f"({chosen}); leave {owner}'s tiers out to use the chosen ones, or include every candidate tier."
        )
    return list(given) if given is not None else trained
