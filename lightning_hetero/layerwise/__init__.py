"""Greedy (and decoupled) layerwise training, framework-free: block splits, auxiliary heads, activation caches.

See ``docs/layerwise.md``. The Lightning side is
:class:`lightning_hetero.strategies.layerwise.callbacks.GreedyLayerwise`.
"""

from lightning_hetero.layerwise.blocks import split_into_blocks
from lightning_hetero.layerwise.cache import CACHE_STORAGES, ActivationCache, content_keys
from lightning_hetero.layerwise.greedy import GreedyStages, SplitMismatchError
from lightning_hetero.layerwise.stack import AUX_HEAD_KINDS, BlockStack

__all__ = [
    "AUX_HEAD_KINDS",
    "CACHE_STORAGES",
    "ActivationCache",
    "BlockStack",
    "GreedyStages",
    "SplitMismatchError",
    "content_keys",
    "split_into_blocks",
]
