"""MatFormer callbacks: elastic granularity sampling, per-tier validation and per-tier export.

These callbacks put the framework-free building blocks of :mod:`lightning_hetero.matformer` (``tier_view``,
``export_tier``) into any Lightning ``Trainer``:

* :class:`MatFormerSampler` trains *every* granularity of one model in a single process (elastic MatFormer): each
  training micro-batch runs its forward, backward and optimizer step inside ``tier_view(pl_module, tier)``, with the
  tier drawn per optimizer step (``rule="random"``) or cycled largest / smallest / random middle across the
  micro-batches of one step (``rule="sandwich"``).
* :class:`TierEvaluation` logs ``val/loss_tier{t}`` and ``val/perplexity_tier{t}`` after every validation epoch.
* :class:`TierExport` writes one standard Hugging Face checkpoint per tier when ``fit`` ends.

A tier ``t`` keeps the first ``h >> t`` hidden units of every FFN (see ``docs/matformer.md``). Under a *tiered*
strategy (one whose ``trainer.strategy`` has a ``tier`` attribute, e.g. ``MatFormerStrategy``), every rank trains its
own fixed tier: the sampler refuses to run there, and evaluation and export happen on global rank 0, which holds the
full (tier-0) model.

This module re-exports them from :mod:`~lightning_hetero.callbacks.tier_sampler`,
:mod:`~lightning_hetero.callbacks.tier_eval`, :mod:`~lightning_hetero.callbacks.tier_export` and the helpers they
share (:mod:`~lightning_hetero.callbacks.tier_common`).
"""

from lightning_hetero.callbacks.tier_common import DEFAULT_MAX_TIER, default_tiers, find_hf_model, strategy_tier
from lightning_hetero.callbacks.tier_eval import TierEvaluation
from lightning_hetero.callbacks.tier_export import TierExport
from lightning_hetero.callbacks.tier_sampler import RULES, MatFormerSampler

__all__ = [
    "DEFAULT_MAX_TIER",
    "RULES",
    "MatFormerSampler",
    "TierEvaluation",
    "TierExport",
    "default_tiers",
    "find_hf_model",
    "strategy_tier",
]
