"""MatFormer's callbacks: :class:`MatFormerSampler` (one tier per micro-batch), :class:`TierEvaluation` (validation
loss per tier) and :class:`TierExport` (one HF checkpoint per tier when ``fit`` ends)."""

from lightning_hetero.strategies.matformer.callbacks.tier_eval import TierEvaluation
from lightning_hetero.strategies.matformer.callbacks.tier_export import TierExport
from lightning_hetero.strategies.matformer.callbacks.tier_sampler import MatFormerSampler

__all__ = ["MatFormerSampler", "TierEvaluation", "TierExport"]
