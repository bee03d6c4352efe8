"""Process-group teardown that survives interpreter exit under gloo.

Why a plain ``destroy_process_group()`` at exit is not enough (diagnosed from a core dump of a spawned 2-rank fit
that aborted with ``terminate called without an active exception`` in about 1 of 8 runs): gloo runs each collective
on a worker thread, and that thread drops its reference to the finished work (and so to the work's tensors) *after*
the caller's ``wait()`` returned. When Python already dropped those tensors, the worker holds the last reference and
must take the GIL to free their Python objects. If the main thread reaches interpreter finalization first, the
worker's GIL request makes CPython end that thread with a forced unwind through a ``noexcept`` destructor:
``std::terminate``, SIGABRT, a failed run after a successful fit. Destroying the default group does not help by itself
(device meshes and strategies keep Python references to their groups, so the worker threads live on).
:func:`release_process_groups` destroys the groups and then releases the GIL for a moment, so pending frees finish
while the interpreter can still serve them.
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

__all__ = ["WORKER_DRAIN_SECONDS", "destroy_process_group_at_exit", "release_process_groups"]

WORKER_DRAIN_SECONDS = 0.1
"""How long :func:`release_process_groups` releases the GIL (a pending free needs it once, for microseconds)."""

_AT_EXIT_REGISTERED = False


def release_process_groups(drain_seconds: float = WORKER_DRAIN_SECONDS) -> None:
    """Destroy every process group of this process (if any) and let collective worker threads finish their frees.

    Call it once no collective is in flight (after a normal end, or after the peers are known to be gone).

    Args:
        drain_seconds: Seconds to sleep with the GIL released after the groups are destroyed.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(drain_seconds)


def destroy_process_group_at_exit() -> None:
    """Run :func:`release_process_groups` at interpreter exit, in every process that calls this, whatever the backend.

    Lightning registers a teardown only for NCCL; under gloo an exit with pending worker frees can abort (see the
    module docstring). Idempotent: registers once per process.
    """
    global _AT_EXIT_REGISTERED
    if not _AT_EXIT_REGISTERED:
        atexit.register(release_process_groups)
        _AT_EXIT_REGISTERED = True
