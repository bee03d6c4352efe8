"""What the MatFormer callbacks share: tier lists, the tiers a model supports, tiered strategies, the HF model.

A tier ``t`` keeps the first ``h >> t`` hidden units of every FFN (see ``docs/matformer.md``). A *tiered* strategy
(one whose ``trainer.strategy`` has a ``tier`` attribute, e.g. ``MatFormerStrategy``) gives every rank its own fixed
tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lightning.pytorch import Trainer
from torch import nn
from transformers import PreTrainedModel

from lightning_hetero.matformer.adapters import FFNBlock, find_ffns

__all__ = [
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
