"""lightning-hetero: Lightning/Fabric strategies for training over slow links and unequal hardware.

Importing this package is cheap (neither Lightning nor transformers is imported): it arranges for our strategy names
(lowercase) to be registered in both the Trainer ``StrategyRegistry`` and Fabric's ``STRATEGY_REGISTRY`` as soon as
Lightning loads them (see :mod:`lightning_hetero.strategies.registry`). The Trainer strategies are importable from
here (``lightning_hetero.FlexDeMoStrategy``, ``MatFormerStrategy``, ``SubspacePipelineStrategy``), the Fabric ones
from :mod:`lightning_hetero.fabric`, and each strategy's typed settings from both (``FlexDeMoSettings``,
``MatFormerSettings``, ``ReplicationSettings``, ...: ``strategies.registry.SETTINGS_CLASSES``); all load on first
access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_hetero.strategies.registry import (
    SETTINGS_CLASSES,
    exported_classes,
    lazy_class,
    register_when_lightning_loads,
)

if TYPE_CHECKING:  # for type checkers (test_registry matches them to the table); at run time: on first access
    from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy as FlexDeMoStrategy
    from lightning_hetero.strategies.layerwise.trainer import LayerwiseStrategy as LayerwiseStrategy
    from lightning_hetero.strategies.lowbit.trainer import SparseFlipStrategy as SparseFlipStrategy
    from lightning_hetero.strategies.matformer.trainer import MatFormerStrategy as MatFormerStrategy
    from lightning_hetero.strategies.subspace.trainer import SubspacePipelineStrategy as SubspacePipelineStrategy

__version__ = "0.1.0"

register_when_lightning_loads()

__all__ = [*exported_classes(fabric=False), "__version__"]  # the table in strategies/registry.py


def __getattr__(name: str) -> Any:
    return lazy_class(name, fabric=False, owner=__name__)


def __dir__() -> list[str]:
    return sorted([*globals(), *exported_classes(fabric=False), *SETTINGS_CLASSES])
