"""lightning-hetero: Lightning/Fabric strategies for training over slow links and unequal hardware.

Importing this package is cheap (neither Lightning nor transformers is imported): it arranges for our strategy names
(lowercase) to be registered in both the Trainer ``StrategyRegistry`` and Fabric's ``STRATEGY_REGISTRY`` as soon as
Lightning loads them (see :mod:`lightning_hetero.strategies.registry`). The Trainer strategies are importable from
here (``lightning_hetero.FlexDeMoStrategy``, ``MatFormerStrategy``, ``SubspacePipelineStrategy``), the Fabric ones
from :mod:`lightning_hetero.fabric`; both load on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_hetero.strategies.registry import register_when_lightning_loads

if TYPE_CHECKING:  # static analysis sees the classes; at run time they load on first access
    from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy
    from lightning_hetero.strategies.layerwise.trainer import LayerwiseStrategy
    from lightning_hetero.strategies.lowbit.trainer import SparseFlipStrategy
    from lightning_hetero.strategies.matformer.trainer import MatFormerStrategy
    from lightning_hetero.strategies.subspace.trainer import SubspacePipelineStrategy

__version__ = "0.1.0"

register_when_lightning_loads()

_TRAINER_STRATEGIES = {
    "FlexDeMoStrategy": "lightning_hetero.strategies.flexdemo.trainer",
    "LayerwiseStrategy": "lightning_hetero.strategies.layerwise.trainer",
    "MatFormerStrategy": "lightning_hetero.strategies.matformer.trainer",
    "SparseFlipStrategy": "lightning_hetero.strategies.lowbit.trainer",
    "SubspacePipelineStrategy": "lightning_hetero.strategies.subspace.trainer",
}

__all__ = [
    "FlexDeMoStrategy",
    "LayerwiseStrategy",
    "MatFormerStrategy",
    "SparseFlipStrategy",
    "SubspacePipelineStrategy",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _TRAINER_STRATEGIES:
        return getattr(importlib.import_module(_TRAINER_STRATEGIES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_TRAINER_STRATEGIES])
