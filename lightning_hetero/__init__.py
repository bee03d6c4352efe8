"""lightning-hetero: Lightning/Fabric strategies for training over slow links and unequal hardware.

Importing this package registers our strategy names (lowercase) in both the Trainer ``StrategyRegistry`` and
Fabric's ``STRATEGY_REGISTRY``; see :mod:`lightning_hetero.strategies.registry`. The Trainer strategies are importable
from here (``lightning_hetero.FlexDeMoStrategy``, ``MatFormerStrategy``, ``SubspacePipelineStrategy``), the Fabric
ones from :mod:`lightning_hetero.fabric`.
"""

from lightning_hetero.strategies.registry import register_builtin_strategies

__version__ = "0.1.0"

register_builtin_strategies()

from lightning_hetero.flexdemo.strategy import FlexDeMoStrategy  # noqa: E402  (already imported by the registry)
from lightning_hetero.matformer.strategy import MatFormerStrategy  # noqa: E402  (already imported by the registry)
from lightning_hetero.subspace.strategy import SubspacePipelineStrategy  # noqa: E402

__all__ = ["FlexDeMoStrategy", "MatFormerStrategy", "SubspacePipelineStrategy", "__version__"]
