"""Test utilities shipped with the package so that every issue's tests can reuse them.

:func:`run_distributed` spawns N ranks in a gloo group and cleans up after success, failure, timeout or Ctrl-C.
"""

from lightning_hetero.testing.multiprocess import DistributedRankError, find_free_port, run_distributed

__all__ = ["DistributedRankError", "find_free_port", "run_distributed"]
