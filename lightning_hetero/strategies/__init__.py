"""The Lightning layer of every strategy: registration, the shared lifecycle and the Trainer/Fabric adapters.

``strategies/<name>/trainer.py`` and ``strategies/<name>/fabric.py`` adapt a framework-free runtime to the Trainer
and to Fabric, on top of :mod:`lightning_hetero.strategies.lifecycle`. Importing this package is cheap: the bases
(and with them Lightning) load on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_hetero.strategies.registry import (
    BUILTIN_STRATEGIES,
    LazyStrategyClass,
    StrategySpec,
    register_builtin_strategies,
    register_strategy,
    register_when_lightning_loads,
)

_LAZY = {
    "TrainerStrategyBase": "lightning_hetero.strategies.lifecycle",
    "FabricStrategyBase": "lightning_hetero.strategies.lifecycle",
    "destroy_process_group_at_exit": "lightning_hetero.reliability.shutdown",
}

__all__ = [
    "BUILTIN_STRATEGIES",
    "FabricStrategyBase",
    "LazyStrategyClass",
    "StrategySpec",
    "TrainerStrategyBase",
    "destroy_process_group_at_exit",
    "register_builtin_strategies",
    "register_strategy",
    "register_when_lightning_loads",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
