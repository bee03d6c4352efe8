"""Run a function on N spawned processes joined in a ``torch.distributed`` group, and clean up no matter what.

:func:`run_distributed` is the harness behind every ``tests/dist`` test. It is built for a small shared CPU box:

- each rank is a ``spawn`` child (``daemon=True``) with ``OMP_NUM_THREADS=1`` and one torch thread;
- the first rank that raises stops the run at once: the parent terminates every other rank instead of waiting for
  gloo's own timeout, and re-raises as :class:`DistributedRankError` with the failing rank's full traceback;
- a run that outlives ``timeout`` is killed and reported as :class:`TimeoutError` naming the unfinished ranks;
- the parent kills and joins every child in a ``finally``, so success, failure, timeout and Ctrl-C leave no orphans;
- ``backend="nccl"`` (or a per-device string such as ``"cpu:gloo,cuda:nccl"``) pins rank ``r`` to GPU
  ``r % device_count`` before the group starts, and refuses up front (:class:`NotEnoughGPUsError`) when there are fewer
  GPUs than ranks: NCCL forbids two ranks on one GPU. Tests skip with :func:`nccl_unavailable_reason`.

``fn`` must be picklable (a module-level function), and so must its arguments and its return value.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

__all__ = ["DistributedRankError", "NotEnoughGPUsError", "find_free_port", "nccl_unavailable_reason", "run_distributed"]

_POLL_SECONDS = 0.05
_TERMINATE_GRACE_SECONDS = 3.0
_DRAIN_SECONDS = 0.5


class DistributedRankError(RuntimeError):
    """A rank of :func:`run_distributed` raised (or died); the message holds its rank and traceback."""

    def __init__(self, rank: int, details: str) -> None:
        self.rank = rank
        self.details = details
        super().__init__(f"rank {rank} failed:\n{details}")


class NotEnoughGPUsError(RuntimeError):
    """:func:`run_distributed` was asked for NCCL ranks that this machine cannot place one per GPU."""


def _uses_nccl(backend: str) -> bool:
    return "nccl" in backend.lower()


def nccl_unavailable_reason(world_size: int) -> str | None:
    """Why ``world_size`` NCCL ranks cannot run here (no CUDA, or fewer GPUs than ranks), or None when they can.

    Example (a test that needs two GPUs):
        >>> reason = nccl_unavailable_reason(2)
        >>> if reason:  # doctest: +SKIP
        ...     pytest.skip(reason)
    """
    import torch

    if not torch.cuda.is_available():
        return f"backend='nccl' needs CUDA, but torch.cuda.is_available() is False (wanted {world_size} GPU ranks)."
    count = torch.cuda.device_count()
    if count < world_size:
        return (
            f"backend='nccl' needs one GPU per rank (NCCL forbids two ranks on one GPU): world_size={world_size}, but"
            f" only {count} GPU(s) are visible. Use backend='gloo', or world_size <= {count}."
        )
    return None


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; a race with other binders is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    env: Mapping[str, str] | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
) -> None:
    """Body of one spawned rank: set up the environment and group, run ``fn``, report ``(status, rank, payload)``."""
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
        }
    )
    os.environ.update(env or {})
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)  # the env var alone is too late: torch was imported while unpickling this target
        if _uses_nccl(backend):
            torch.cuda.set_device(rank % torch.cuda.device_count())  # before the group: NCCL binds to this device
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        message = ("ok", rank, pickle.dumps(fn(rank, world_size, *args, **kwargs)))
    except BaseException:
        message = ("error", rank, traceback.format_exc())
    # Report and flush *before* tearing the group down: once our sockets close, peers fail too, and the parent must
    # see the root cause first.
    results.put(message)
    results.close()
    results.join_thread()
    from lightning_hetero.reliability.shutdown import release_process_groups

    release_process_groups()  # also lets gloo's worker threads finish their frees before the interpreter exits


def _stop_all(processes: list[Any]) -> None:
    """Terminate, then kill, then join every process; safe to call twice."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks of one process group.

    Args:
        fn: Picklable (module-level) function; its return value must be picklable too.
        world_size: Number of ranks to spawn.
        *args: Positional arguments passed to ``fn`` after ``rank, world_size``.
        backend: ``torch.distributed`` backend: ``"gloo"``, or ``"nccl"`` with one visible GPU per rank (rank ``r`` uses
            ``cuda:r % device_count``).
        timeout: Wall-clock seconds for the whole run, process start-up included; also the process group timeout.
        env: Extra environment variables for the children (applied after the defaults, so they win).
        **kwargs: Keyword arguments passed to ``fn`` (``backend``, ``timeout`` and ``env`` are taken by this function).

    Returns:
        The return values of ``fn``, ordered by rank.

    Raises:
        DistributedRankError: A rank raised, or exited without reporting; the message has its rank and traceback.
        TimeoutError: Some ranks had not finished after ``timeout`` seconds; the message names them.
        NotEnoughGPUsError: An NCCL backend without CUDA or with fewer GPUs than ranks (raised before spawning).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if _uses_nccl(backend):
        reason = nccl_unavailable_reason(world_size)
        if reason is not None:
            raise NotEnoughGPUsError(reason)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    processes = [
        context.Process(
            target=_worker,
            args=(rank, world_size, port, backend, timeout, env, fn, args, kwargs, results),
            daemon=True,
            name=f"run_distributed-rank{rank}",
        )
        for rank in range(world_size)
    ]
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.start()
        while len(outputs) < world_size:
            message = _next_message(results, _POLL_SECONDS)
            if message is None:
                dead = [rank for rank, p in enumerate(processes) if rank not in outputs and p.exitcode is not None]
                if dead:
                    # A rank that just exited may have its result still in the pipe: drain before blaming it.
                    message = _next_message(results, _DRAIN_SECONDS)
                    if message is None:
                        code = processes[dead[0]].exitcode
                        raise DistributedRankError(
                            dead[0], f"process exited with code {code} without reporting a result or an exception."
                        )
                elif time.monotonic() > deadline:
                    missing = [rank for rank in range(world_size) if rank not in outputs]
                    raise TimeoutError(
                        f"run_distributed({getattr(fn, '__name__', fn)!r}): ranks {missing} did not finish within"
                        f" {timeout:g} s; all ranks were killed."
                    )
                else:
                    continue
            status, rank, payload = message
            if status == "error":
                raise DistributedRankError(rank, payload)
            outputs[rank] = pickle.loads(payload)
    finally:
        _stop_all(processes)
        results.close()
        results.join_thread()
    return [outputs[rank] for rank in range(world_size)]


def _next_message(results: Any, wait: float) -> tuple[str, int, Any] | None:
    try:
        return results.get(timeout=wait)
    except queue_module.Empty:
        return None
