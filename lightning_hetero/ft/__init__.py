"""Spot workers: a replica group (node) can leave or join mid-run while the others keep training, on torchft.

- :mod:`~lightning_hetero.ft.settings`: :class:`FaultToleranceSettings`, one frozen dataclass (no torchft needed).
- :mod:`~lightning_hetero.ft.codec`: a recovery checkpoint as safetensors plus validated JSON, never pickled.
- :mod:`~lightning_hetero.ft.transport`: :class:`SafeCheckpointTransport`, torchft's ``CheckpointTransport`` on that
  codec (needs torchft).
- :mod:`~lightning_hetero.ft.replicas`: :class:`FaultTolerantReplica`, one replica group on torchft's ``Manager``:
  quorum, the mean over the replicas present, ``should_commit``, state for healing (needs torchft).
- :mod:`~lightning_hetero.ft.waiting`: :class:`~lightning_hetero.ft.waiting.QuorumWait`, waiting (with a log line)
  while fewer than ``min_replicas`` are present or the lighthouse is down, up to ``wait_for_replicas_s``.
- :mod:`~lightning_hetero.ft.data`: each replica group's shard of one training set (torchft's ``DistributedSampler``).

torchft is the optional extra ``ft`` (``pip install 'lightning-hetero[ft]'``); it is imported lazily, so this package
and the core import without it. See ``docs/spot.md``.
"""

from __future__ import annotations

from lightning_hetero.ft._deps import INSTALL_HINT, require_torchft
from lightning_hetero.ft.settings import FaultToleranceSettings

__all__ = ["INSTALL_HINT", "FaultToleranceSettings", "require_torchft"]
