"""What the MatFormer callbacks share: tier lists and where they come from, the tiers a model supports, tiered
strategies, the HF model.

A tier ``t`` keeps the first ``h >> t`` hidden units of every FFN (see ``docs/matformer.md``). A *tiered* strategy
(one whose ``trainer.strategy`` has a ``tier`` attribute, e.g. ``MatFormerStrategy``) gives every rank its own fixed
tier. :func:`callback_tiers` lets ``TierEvaluation`` and ``TierExport`` read their tiers from the MatFormer strategy
(or a ``MatFormerSampler``), so a YAML writes the tier list once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lightning.pytorch import Trainer
from torch import nn
from transformers import PreTrainedModel

from lightning_hetero.matformer.adapters import FFNBlock, find_ffns
from lightning_hetero.matformer.settings import MatFormerSettings

__all__ = [
    "callback_tiers",
    "check_tiers_fit",
    "find_hf_model",
    "is_tiered",
    "max_tier",
    "runnable",
    "strategy_tier",
    "validate_limit",
    "validate_tiers",
]


def strategy_tier(trainer: Trainer) -> int | None:
    """This rank's tier under a tiered strategy (``trainer.strategy.tier``), or None for any other strategy."""
    return getattr(trainer.strategy, "tier", None)


def is_tiered(trainer: Trainer) -> bool:
    """Whether the strategy trains a fixed tier per rank (it has a ``tier`` attribute, even if not set yet)."""
    try:
        return hasattr(trainer.strategy, "tier")
    except Exception:  # a property that fails before setup still marks a tiered strategy
        return True


def validate_tiers(owner: str, tiers: Any) -> list[int]:
    """A copy of ``tiers`` after checking it is a non-empty list of distinct ints >= 0."""
    if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Iterable):
        raise ValueError(f"{owner}(tiers={tiers!r}): pass a list of tiers, e.g. tiers=[0, 1, 2, 3].")
    tiers = list(tiers)
    if not tiers:
        raise ValueError(f"{owner}(tiers=[]): pass at least one tier, e.g. tiers=[0, 1, 2, 3].")
    for tier in tiers:
        if isinstance(tier, bool) or not isinstance(tier, int) or tier < 0:
            raise ValueError(
                f"{owner}(tiers={tiers!r}): every tier must be an int >= 0 (tier t keeps h >> t FFN units), "
                f"got {tier!r}."
            )
    if len(set(tiers)) != len(tiers):
        raise ValueError(f"{owner}(tiers={tiers!r}): tiers must be distinct; drop the duplicates.")
    return tiers


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
    from lightning_hetero.callbacks.tier_sampler import MatFormerSampler  # tier_sampler imports this module

    samplers = [callback for callback in trainer.callbacks if isinstance(callback, MatFormerSampler)]
    if samplers:
        return list(samplers[0].tiers)
    raise ValueError(
        f"{owner}: no tiers given, and {type(trainer.strategy).__name__} is not MatFormerStrategy (whose "
        f"settings.tiers would be read) and no MatFormerSampler trains tiers here; pass {owner}(tiers=[0, 1, 2, 3]) "
        "(tier t keeps h >> t FFN units)."
    )


def validate_limit(owner: str, limit_batches: Any) -> None:
    """Refuse a ``limit_batches`` that is neither None nor a positive int."""
    if limit_batches is None:
        return
    if isinstance(limit_batches, bool) or not isinstance(limit_batches, int) or limit_batches < 1:
        raise ValueError(
            f"{owner}(limit_batches={limit_batches!r}): use a positive int, or None for the number of batches "
            "Lightning's validation loop uses."
        )


def max_tier(blocks: Sequence[FFNBlock]) -> int:
    """The largest tier every FFN's full size is divisible by (each tier must halve every FFN exactly)."""
    tier = 0
    while all(block.full_size % (1 << (tier + 1)) == 0 for block in blocks):
        tier += 1
    return tier


def check_tiers_fit(owner: str, model: nn.Module, tiers: Sequence[int]) -> None:
    """Raise a ``ValueError`` naming ``owner``'s ``tiers`` if the FFNs of ``model`` cannot run one of them."""
    blocks = find_ffns(model)  # raises UnsupportedModelError naming the supported families
    sizes = sorted({block.full_size for block in blocks})
    highest = max_tier(blocks)
    for tier in tiers:
        if tier > highest:
            raise ValueError(
                f"{owner}(tiers={list(tiers)}): tier {tier} needs every FFN size ({sizes}) to be divisible by "
                f"2**{tier} = {1 << tier}; this model supports tiers 0..{highest}. Drop tier {tier}."
            )
        for block in blocks:
            if block.full_size >> tier > block.width:
                raise ValueError(
                    f"{owner}(tiers={list(tiers)}): FFN {block.path} is already sliced to width {block.width} (full "
                    f"{block.full_size}), so it cannot run tier {tier} (width {block.full_size >> tier}). Use the "
                    "full-width model, or drop the lower tiers."
                )


def runnable(blocks: Sequence[FFNBlock], tier: int) -> bool:
    """Whether a (possibly sliced) model still holds every FFN unit that ``tier`` needs."""
    return all(block.full_size >> tier <= block.width for block in blocks)


def find_hf_model(module: nn.Module, owner: str = "TierExport") -> PreTrainedModel:
    """The Hugging Face model inside a LightningModule: ``module.model`` if it is one, else the first one found.

    Args:
        module: A LightningModule (or any ``nn.Module``), or an HF model itself.
        owner: Name used in the error message.

    Raises:
        ValueError: ``module`` holds no ``PreTrainedModel``.
    """
    model = getattr(module, "model", None)
    if isinstance(model, PreTrainedModel):
        return model
    for _, submodule in module.named_modules():  # pre-order: the outermost HF model comes first
        if isinstance(submodule, PreTrainedModel):
            return submodule
    raise ValueError(
        f"{owner} needs a Hugging Face PreTrainedModel inside {type(module).__name__} (as `.model` or any "
        "submodule), but found none. Build the model in __init__ or configure_model as an HF PreTrainedModel."
    )
