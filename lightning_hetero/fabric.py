"""Fabric strategies of lightning-hetero (the Trainer strategies live at the package top level).

``Fabric(strategy=MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1])))`` or
``Fabric(strategy="matformer")``; likewise ``FlexDeMoStrategy`` (``"flexdemo"``) and ``SubspacePipelineStrategy``
(``"subspace_pipeline"``). The typed settings are here too (``FlexDeMoStrategy(settings=FlexDeMoSettings(
shard_size=2))``). Each class loads on first access.
"""

from __future__ import annotations

from typing import Any

from lightning_hetero.strategies.registry import exported_classes, exported_names, lazy_class

__all__ = list(exported_classes(fabric=True))  # derived from the one table in strategies/registry.py


def __getattr__(name: str) -> Any:
    return lazy_class(name, fabric=True, owner=__name__)


def __dir__() -> list[str]:
    return sorted([*globals(), *exported_names(fabric=True)])
