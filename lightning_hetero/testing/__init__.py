"""Test utilities shipped with the package so that every issue's tests can reuse them.

:func:`run_distributed` spawns N ranks in a gloo (or, with one GPU per rank, NCCL) group and cleans up after success,
failure, timeout or Ctrl-C.
"""

from lightning_hetero.testing.multiprocess import (
    DistributedRankError,
    NotEnoughGPUsError,
    find_free_port,
    nccl_unavailable_reason,
    run_distributed,
)

__all__ = ["DistributedRankError", "NotEnoughGPUsError", "find_free_port", "nccl_unavailable_reason", "run_distributed"]
