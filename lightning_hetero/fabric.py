"""Fabric strategies of lightning-hetero (the Trainer strategies live at the package top level).

``Fabric(strategy=MatFormerStrategy(tiers=[0, 1]))`` or ``Fabric(strategy="matformer")``; likewise
``FlexDeMoStrategy`` (``"flexdemo"``) and ``SubspacePipelineStrategy`` (``"subspace_pipeline"``).
"""

from lightning_hetero.flexdemo.fabric import FlexDeMoStrategy
from lightning_hetero.matformer.fabric import MatFormerStrategy
from lightning_hetero.subspace.fabric import SubspacePipelineStrategy

__all__ = ["FlexDeMoStrategy", "MatFormerStrategy", "SubspacePipelineStrategy"]
