"""What one rank can measure about itself: its memory limit, its peak memory, the wall time of a call.

Framework-free (torch only). Used at fit start by the measured heterogeneity features (MatFormer ``tiers: auto``,
batch shares) to probe each rank before the first step.

Memory on CUDA is the *allocator's* view: ``memory_limit_bytes`` is the device's total memory and
``peak_memory_bytes`` is ``torch.cuda.max_memory_reserved`` (what the caching allocator held at its peak, which is
what an out-of-memory error is measured against; ``max_memory_allocated`` is lower by the cache's slack). On CPU it
is the kernel's view on Linux: the limit of the memory cgroup this process is in and, when that cgroup has a
limit, the cgroup's own peak charge (v1 ``memory.max_usage_in_bytes``, reset by writing ``0``; v2 ``memory.peak``,
the peak since the group was made), because that charge is what the kernel compares with the limit: a process's
resident set also counts shared-library pages charged elsewhere (measured: a Lightning worker's ``VmHWM`` is
hundreds of MB above its group's charge). Without a limited cgroup, the peak is the resident-set high-water mark
(``VmHWM`` of ``/proc/self/status``, reset by writing ``5`` to ``/proc/self/clear_refs``), or the current resident
set where that cannot be reset (no permission, not Linux).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["memory_limit_bytes", "peak_memory_bytes", "reset_peak_memory", "time_call"]

UNLIMITED = 2**60
"""A cgroup limit at or above this is the kernel's "no limit" (v1 writes 2**63 rounded down to a page)."""
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC = Path("/proc/self")


def memory_limit_bytes(device: torch.device) -> int | None:
    """The memory this rank may use on ``device``.

    Args:
        device: The rank's compute device.

    Returns:
        On CUDA, the device's total memory. On CPU, the limit of this process's memory cgroup (v2 ``memory.max``,
        or v1 ``memory.limit_in_bytes``), found through ``/proc/self/cgroup``. None when there is no limit
        (unlimited, ``max``, or at least 2**60) or it cannot be read.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type != "cpu":
        return None
    return _cgroup_limit(_PROC / "cgroup", _CGROUP_ROOT)


def _cgroup_files(proc_cgroup: Path, root: Path, names: tuple[str, str]) -> list[Path]:
    """The files ``names`` (v2 name, v1 name) of the process's memory cgroup and its ancestors, deepest first."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    files: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2 (unified)
            bases, name = [root, root / "unified"], names[0]
        elif "memory" in controllers.split(","):  # cgroup v1
            bases, name = [root / "memory"], names[1]
        else:
            continue
        segments = [s for s in path.split("/") if s]
        for base in bases:
            files += [base.joinpath(*segments[:depth]) / name for depth in range(len(segments), -1, -1)]
    return files


def _limited_cgroup_peak_file(proc_cgroup: Path | None = None, root: Path | None = None) -> Path | None:
    """The peak-charge file of the deepest memory cgroup of this process that has a finite limit, if readable."""
    proc_cgroup = _PROC / "cgroup" if proc_cgroup is None else proc_cgroup
    limits = _cgroup_files(proc_cgroup, _CGROUP_ROOT if root is None else root, ("memory.max", "memory.limit_in_bytes"))
    for limit_file in limits:
        if _read_limit(limit_file) is not None:
            for name in ("memory.max_usage_in_bytes", "memory.peak"):
                if (limit_file.parent / name).is_file():
                    return limit_file.parent / name
            return None
    return None


def _cgroup_limit(proc_cgroup: Path, root: Path) -> int | None:
    """The memory limit of the cgroup named in ``proc_cgroup`` under the cgroup mount ``root``.

    A cgroup is bounded by every ancestor too, so the smallest limit found along its path (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) counts. Inside a container the mount's root is often the process's own cgroup while
    ``/proc/self/cgroup`` names the host's path: the paths that do not exist are skipped and the mount root counts.
    """
    files = _cgroup_files(proc_cgroup, root, ("memory.max", "memory.limit_in_bytes"))
    limits = [limit for limit in (_read_limit(f) for f in files) if isinstance(limit, int)]
    return min(limits) if limits else None


def _read_limit(path: Path) -> int | None:
    """The finite limit in ``path``; None when the file is absent, unreadable, or says "unlimited"."""
    try:
        text = path.read_text().strip()
        value = int(text)
    except (OSError, ValueError):  # absent, or "max" (v2's "unlimited")
        return None
    return None if value >= UNLIMITED or value <= 0 else value


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window on ``device`` (see ``peak_memory_bytes``).

    Args:
        device: The rank's compute device.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    peak_file = _limited_cgroup_peak_file()
    if peak_file is not None and peak_file.name == "memory.max_usage_in_bytes":
        try:
            peak_file.write_text("0")  # v1: restarts the group's peak at its current charge
        except OSError:
            pass
    try:
        (_PROC / "clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or no permission: peak_memory_bytes falls back to the current resident set


def peak_memory_bytes(device: torch.device) -> int:
    """The peak memory since the last ``reset_peak_memory`` on ``device``.

    Args:
        device: The rank's compute device.

    Returns:
        On CUDA, ``torch.cuda.max_memory_reserved`` (the caching allocator's peak). On CPU in a memory cgroup with
        a limit, the group's peak charge (shared by every process of the group: on a node of several ranks, theirs
        too); otherwise the process's resident-set high-water mark (``VmHWM``), or its current resident set
        (``VmRSS``) where the high-water mark is unavailable; 0 when neither can be read.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    peak_file = _limited_cgroup_peak_file()
    if peak_file is not None:
        try:
            return int(peak_file.read_text().strip())
        except (OSError, ValueError):
            pass
    status = _proc_status()
    for key in ("VmHWM", "VmRSS"):
        if key in status:
            return status[key]
    return _rss_from_resource()


def _proc_status() -> dict[str, int]:
    """The ``kB`` fields of ``/proc/self/status``, in bytes."""
    found: dict[str, int] = {}
    try:
        text = (_PROC / "status").read_text()
    except OSError:
        return found
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
            found[key] = int(fields[0]) * 1024
    return found


def _rss_from_resource() -> int:
    """The process's maximum resident set size from ``getrusage`` (not resettable); 0 where unavailable."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return 0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) * (1 if os.uname().sysname == "Darwin" else 1024)


def time_call(fn: Callable[[], object], device: torch.device, *, repeats: int = 3, warmup: int = 1) -> float:
    """The median wall time of ``fn()`` in seconds.

    Args:
        fn: The call to time (e.g. one training step on a probe batch).
        device: The device ``fn`` runs on; on CUDA the device is synchronized before and after each call so that
            the time covers the kernels, not just their launch.
        repeats: Timed calls (at least 1); the median is returned.
        warmup: Untimed calls first (allocator warm-up, lazy initialization, autotuning).

    Returns:
        The median of ``repeats`` wall times, in seconds.

    Raises:
        ValueError: If ``repeats`` < 1 or ``warmup`` < 0.
    """
    if repeats < 1:
        raise ValueError(f"time_call: repeats={repeats} must be >= 1")
    if warmup < 0:
        raise ValueError(f"time_call: warmup={warmup} must be >= 0")
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync(device)
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync(device)
        times.append(time.perf_counter() - start)
    return float(statistics.median(times))
