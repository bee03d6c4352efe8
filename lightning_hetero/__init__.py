"""lightning-hetero: Lightning/Fabric strategies for training over slow links and unequal hardware.

Importing this package registers our strategy names (lowercase) in both the Trainer ``StrategyRegistry`` and
Fabric's ``STRATEGY_REGISTRY``; see :mod:`lightning_hetero.strategies.registry`.
"""

from lightning_hetero.strategies.registry import register_builtin_strategies

__version__ = "0.1.0"

register_builtin_strategies()

__all__ = ["__version__"]
