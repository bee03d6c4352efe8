"""Fabric strategies of lightning-hetero (the Trainer strategies live at the package top level).

``Fabric(strategy=MatFormerStrategy(tiers=[0, 1]))`` or ``Fabric(strategy="matformer")``.
"""

from lightning_hetero.flexdemo.fabric import FlexDeMoStrategy
from lightning_hetero.matformer.fabric import MatFormerStrategy

__all__ = ["FlexDeMoStrategy", "MatFormerStrategy"]
