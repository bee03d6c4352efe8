"""Generic Lightning callbacks shipped with lightning-hetero (usable from LightningCLI YAML by class path).

A callback that serves one method lives with that method's Lightning code:
``lightning_hetero.strategies.matformer.callbacks`` (tiers), ``lightning_hetero.strategies.subspace_pipeline.callbacks``
and ``lightning_hetero.strategies.layerwise.callbacks``.
"""

from lightning_hetero.callbacks.comm_monitor import CommunicationMonitor
from lightning_hetero.callbacks.eval_report import ValidationReport
from lightning_hetero.callbacks.periodic_checkpoint import VerifiedCheckpoint
from lightning_hetero.callbacks.progress import ThroughputProgressBar

__all__ = [
    "CommunicationMonitor",
    "ThroughputProgressBar",
    "ValidationReport",
    "VerifiedCheckpoint",
]
