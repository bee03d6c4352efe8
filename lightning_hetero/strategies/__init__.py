"""Strategy registration shared by all lightning-hetero strategies (each strategy lives in its own subpackage)."""

from lightning_hetero.strategies.registry import (
    BUILTIN_STRATEGIES,
    StrategySpec,
    register_builtin_strategies,
    register_strategy,
)

__all__ = ["BUILTIN_STRATEGIES", "StrategySpec", "register_builtin_strategies", "register_strategy"]
