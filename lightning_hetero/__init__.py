"""lightning-hetero: Lightning/Fabric strategies for training over slow links and unequal hardware.

Importing this package is cheap (neither Lightning nor transformers is imported): it arranges for our strategy names
(lowercase) to be registered in both the Trainer ``StrategyRegistry`` and Fabric's ``STRATEGY_REGISTRY`` as soon as
Lightning loads them (see :mod:`lightning_hetero.strategies.registry`). The Trainer strategies are importable from
here (``lightning_hetero.FlexDeMoStrategy``, ``MatFormerStrategy``, ``SubspacePipelineStrategy``), the Fabric ones
from :mod:`lightning_hetero.fabric`, and each strategy's typed settings from both (``FlexDeMoSettings``,
``MatFormerSettings``, ``ReplicationSettings``, ...); all load on first access, from the one table in
:mod:`lightning_hetero.strategies.registry`.
"""

from __future__ import annotations

from typing import Any

from lightning_hetero.strategies.registry import (
    exported_classes,
    exported_names,
    lazy_class,
    register_when_lightning_loads,
)

# The strategy and settings classes are lazy attributes derived from the one table (``_STRATEGIES`` in
# strategies/registry.py); no TYPE_CHECKING import list repeats it (a second copy that drifts): a type checker sees
# them as ``Any`` here, and precisely when imported from their modules (``lightning_hetero.strategies.<name>.trainer``).

__version__ = "0.1.0"

register_when_lightning_loads()

__all__ = [*exported_classes(fabric=False), "__version__"]


def __getattr__(name: str) -> Any:
    return lazy_class(name, fabric=False, owner=__name__)


def __dir__() -> list[str]:
    return sorted([*globals(), *exported_names(fabric=False)])
