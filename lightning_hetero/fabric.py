"""Fabric strategies of lightning-hetero (the Trainer strategies live at the package top level).

``Fabric(strategy=MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1])))`` or
``Fabric(strategy="matformer")``; likewise ``FlexDeMoStrategy`` (``"flexdemo"``) and ``SubspacePipelineStrategy``
(``"subspace_pipeline"``). The typed settings are here too (``FlexDeMoStrategy(settings=FlexDeMoSettings(
shard_size=2))``). Each class loads on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_hetero.strategies.registry import SETTINGS_CLASSES, exported_classes, lazy_class

if TYPE_CHECKING:  # for type checkers (test_registry matches them to the table); at run time: on first access
    from lightning_hetero.strategies.flexdemo.fabric import FlexDeMoStrategy as FlexDeMoStrategy
    from lightning_hetero.strategies.layerwise.fabric import LayerwiseStrategy as LayerwiseStrategy
    from lightning_hetero.strategies.lowbit.fabric import SparseFlipStrategy as SparseFlipStrategy
    from lightning_hetero.strategies.matformer.fabric import MatFormerStrategy as MatFormerStrategy
    from lightning_hetero.strategies.subspace.fabric import SubspacePipelineStrategy as SubspacePipelineStrategy

__all__ = list(exported_classes(fabric=True))  # the table in strategies/registry.py


def __getattr__(name: str) -> Any:
    return lazy_class(name, fabric=True, owner=__name__)


def __dir__() -> list[str]:
    return sorted([*globals(), *exported_classes(fabric=True), *SETTINGS_CLASSES])
