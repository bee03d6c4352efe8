"""Lightning callbacks shipped with lightning-hetero (usable from LightningCLI YAML by class path)."""

from lightning_hetero.callbacks.comm_monitor import CommunicationMonitor
from lightning_hetero.callbacks.eval_report import ValidationReport
from lightning_hetero.callbacks.layerwise import GreedyLayerwise
from lightning_hetero.callbacks.periodic_checkpoint import VerifiedCheckpoint
from lightning_hetero.callbacks.progress import ThroughputProgressBar
from lightning_hetero.callbacks.subspace_export import SubspaceDenseExport
from lightning_hetero.callbacks.subspace_rank import SubspaceRankMonitor
from lightning_hetero.callbacks.tier_eval import TierEvaluation
from lightning_hetero.callbacks.tier_export import TierExport
from lightning_hetero.callbacks.tier_sampler import MatFormerSampler

__all__ = [
    "CommunicationMonitor",
    "GreedyLayerwise",
    "MatFormerSampler",
    "SubspaceDenseExport",
    "SubspaceRankMonitor",
    "ThroughputProgressBar",
    "TierEvaluation",
    "TierExport",
    "ValidationReport",
    "VerifiedCheckpoint",
]
