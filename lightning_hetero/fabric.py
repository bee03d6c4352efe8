"""Fabric strategies of lightning-hetero (the Trainer strategies live at the package top level).

``Fabric(strategy=MatFormerStrategy(tiers=[0, 1]))`` or ``Fabric(strategy="matformer")``; likewise
``FlexDeMoStrategy`` (``"flexdemo"``) and ``SubspacePipelineStrategy`` (``"subspace_pipeline"``). Each class loads on
first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # static analysis sees the classes; at run time they load on first access
    from lightning_hetero.strategies.flexdemo.fabric import FlexDeMoStrategy
    from lightning_hetero.strategies.layerwise.fabric import LayerwiseStrategy
    from lightning_hetero.strategies.lowbit.fabric import SparseFlipStrategy
    from lightning_hetero.strategies.matformer.fabric import MatFormerStrategy
    from lightning_hetero.strategies.subspace.fabric import SubspacePipelineStrategy

_FABRIC_STRATEGIES = {
    "FlexDeMoStrategy": "lightning_hetero.strategies.flexdemo.fabric",
    "LayerwiseStrategy": "lightning_hetero.strategies.layerwise.fabric",
    "MatFormerStrategy": "lightning_hetero.strategies.matformer.fabric",
    "SparseFlipStrategy": "lightning_hetero.strategies.lowbit.fabric",
    "SubspacePipelineStrategy": "lightning_hetero.strategies.subspace.fabric",
}

__all__ = [
    "FlexDeMoStrategy",
    "LayerwiseStrategy",
    "MatFormerStrategy",
    "SparseFlipStrategy",
    "SubspacePipelineStrategy",
]


def __getattr__(name: str) -> Any:
    if name in _FABRIC_STRATEGIES:
        return getattr(importlib.import_module(_FABRIC_STRATEGIES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_FABRIC_STRATEGIES])
