"""Greedy (and decoupled) layerwise training, framework-free: block splits, auxiliary heads, activation caches.

See ``docs/layerwise.md``. The Lightning side is :class:`lightning_hetero.callbacks.GreedyLayerwise`.
"""

from lightning_hetero.layerwise.blocks import AUX_HEAD_KINDS, BlockStack, split_into_blocks

__all__ = ["AUX_HEAD_KINDS", "BlockStack", "split_into_blocks"]
