"""Per-node cgroups: each testbed node gets a CPU quota and a memory limit of its own, enforced by the kernel.

One group per node and run, named ``lhtb-<id>-n<k>`` (the run's namespace prefix, so ``--cleanup`` finds it), made
at the root of each cgroup hierarchy that holds a needed controller:

- **cgroup v1** (one hierarchy per controller): ``cpu`` (``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` = 100000,
  ``cpu.shares``), ``memory`` (``memory.limit_in_bytes``, and ``memory.memsw.limit_in_bytes`` when swap accounting
  exists, so swap cannot dodge the limit), plus ``cpuacct`` when mounted, only to read the CPU time used.
- **cgroup v2** (one unified hierarchy): ``cpu.max``, ``cpu.weight``, ``memory.max``, ``memory.swap.max`` = 0.

v2 is used when its root offers every needed controller, else v1. Processes join their node's group before they
exec: :func:`join_command` wraps an argv in ``sh -c 'echo $$ > .../cgroup.procs && exec "$@"'``, so the command and
everything it forks (torchrun's workers) start inside the limits. The wrapper runs *outside* ``ip netns exec``,
which remounts ``/sys`` and would hide ``/sys/fs/cgroup``.

A quota is a ceiling; the group's weight (``cpu.shares`` 4096 per core of quota, ``cpu.weight`` 400 per core, 4x a
plain process) makes it close to a floor as well, so a node still gets its quota on a machine busy with other work,
and nodes that together ask for more cores than exist share them in the ratio of their quotas.

Stdlib only; nothing here imports Lightning.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_hetero.testbed.netns import NAME_PREFIX, TestbedError, run_owner_pid

__all__ = [
    "CPU_PERIOD_MICROSECONDS",
    "MIN_CPU_QUOTA",
    "CgroupLayout",
    "CgroupMount",
    "CgroupUnavailable",
    "CgroupUsage",
    "JOIN_FAILED_EXIT_CODE",
    "NodeCgroup",
    "NodeLimits",
    "RunCgroups",
    "cleanup_leftover_cgroups",
    "create_node_cgroups",
    "join_command",
    "list_testbed_cgroups",
    "view_command",
    "omp_threads_for_quota",
    "read_cgroup_mounts",
    "select_layout",
]

CPU_PERIOD_MICROSECONDS = 100_000
#: The kernel refuses a CFS quota below 1 ms per period.
MIN_CPU_QUOTA = 0.01
_SHARES_PER_CORE = 4096  # v1 cpu.shares: a plain process weighs 1024
_WEIGHT_PER_CORE = 400  # v2 cpu.weight: a plain process weighs 100
_V1_CONTROLLERS = frozenset(
    {"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls", "net_prio", "blkio", "perf_event"}
    | {"hugetlb", "pids", "rdma", "misc"}
)
_GROUP_PATTERN = re.compile(r"^lhtb-(?P<run_id>[0-9a-f]+)-")
_REMOVE_WAIT_SECONDS = 5.0
#: Exit status of the join wrapper when the pid cannot be written (as ``env``'s 125: the launcher itself failed).
JOIN_FAILED_EXIT_CODE = 125


class CgroupUnavailable(RuntimeError):
    """A needed controller is not mounted or not enabled; the message says which and where it looked."""


# -- seams the unit tests replace with a fake kernel (a tmp_path tree has no control files or busy rmdir) -------------
def _make_group_directory(path: Path) -> None:
    path.mkdir()


def _remove_group_directory(path: Path) -> None:
    path.rmdir()


@dataclass(frozen=True)
class CgroupMount:
    """One mounted cgroup hierarchy: its version, where it is, and the controllers it offers."""

    version: int
    path: Path
    controllers: frozenset[str]


@dataclass(frozen=True)
class CgroupLayout:
    """Where this run's groups go: one base directory per hierarchy used (v1: per controller; v2: one)."""

    version: int
    #: v1: controller -> hierarchy root (``cpuacct`` only when mounted); v2: ``{"unified": root}``.
    bases: dict[str, Path]

    @property
    def hierarchies(self) -> list[Path]:
        """The distinct base directories (``cpu`` and ``cpuacct`` may be co-mounted in one)."""
        return list(dict.fromkeys(self.bases.values()))


@dataclass(frozen=True)
class NodeLimits:
    """What one node may use: cores of CPU time (1.5 = one and a half cores) and bytes of memory; None = unlimited."""

    cpu_quota: float | None = None
    memory_limit_bytes: int | None = None


@dataclass(frozen=True)
class CgroupUsage:
    """Counters of one node's group; None where this kernel does not expose the file."""

    cpu_seconds: float | None = None
    cpu_throttled_periods: int | None = None
    cpu_throttled_seconds: float | None = None
    memory_peak_bytes: int | None = None
    memory_limit_hits: int | None = None
    oom_kills: int | None = None

    def since(self, earlier: CgroupUsage) -> CgroupUsage:
        """Counters as deltas from ``earlier``; the peak stays as read (it is reset at the run's start in v1)."""

        def delta(now: Any, then: Any) -> Any:
            return None if now is None or then is None else now - then

        return CgroupUsage(
            cpu_seconds=delta(self.cpu_seconds, earlier.cpu_seconds),
            cpu_throttled_periods=delta(self.cpu_throttled_periods, earlier.cpu_throttled_periods),
            cpu_throttled_seconds=delta(self.cpu_throttled_seconds, earlier.cpu_throttled_seconds),
            memory_peak_bytes=self.memory_peak_bytes,
            memory_limit_hits=delta(self.memory_limit_hits, earlier.memory_limit_hits),
            oom_kills=delta(self.oom_kills, earlier.oom_kills),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)


def _unescape_mount_path(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match[1], 8)), text)


def read_cgroup_mounts(mountinfo: str | None = None) -> list[CgroupMount]:
    """Every cgroup hierarchy mounted here, first mount of each.

    Args:
        mountinfo: The text of ``/proc/self/mountinfo`` (read when None). v2 controllers come from the mount's
            ``cgroup.controllers`` file, v1 controllers from the mount's super options.
    """
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    mounts: list[CgroupMount] = []
    seen: set[frozenset[str]] = set()
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        path = Path(_unescape_mount_path(fields[4]))
        if tail[0] == "cgroup2":
            try:
                controllers = frozenset((path / "cgroup.controllers").read_text().split())
            except OSError:
                controllers = frozenset()
            mounts.append(CgroupMount(2, path, controllers))
            continue
        controllers = frozenset(option for option in tail[2].split(",") if option in _V1_CONTROLLERS)
        if controllers and controllers not in seen:  # a hierarchy mounted twice is one hierarchy
            seen.add(controllers)
            mounts.append(CgroupMount(1, path, controllers))
    return mounts


def select_layout(controllers: Collection[str], mounts: Sequence[CgroupMount] | None = None) -> CgroupLayout:
    """Pick the hierarchy version that offers every controller in ``controllers`` (v2 first, then v1).

    Raises:
        CgroupUnavailable: Some controller is in neither; the message names it and the mounts looked at.
    """
    mounts = read_cgroup_mounts() if mounts is None else mounts
    needed = set(controllers)
    for mount in mounts:
        if mount.version == 2 and needed <= mount.controllers:
            return CgroupLayout(2, {"unified": mount.path})
    v1 = [mount for mount in mounts if mount.version == 1]
    bases = {name: mount.path for name in sorted(needed) for mount in v1 if name in mount.controllers}
    missing = sorted(needed - set(bases))
    if missing:
        v2_roots = [str(mount.path) for mount in mounts if mount.version == 2]
        raise CgroupUnavailable(
            f"cgroup controller(s) {', '.join(missing)} not available: no cgroup v1 hierarchy has them and the"
            f" cgroup v2 root ({', '.join(v2_roots) or 'not mounted'}) does not offer them"
        )
    accounting = [mount.path for mount in v1 if "cpuacct" in mount.controllers]
    if accounting and "cpuacct" not in bases:  # only read (CPU time used), so optional
        bases["cpuacct"] = accounting[0]
    return CgroupLayout(1, bases)


def join_command(procs_files: Sequence[str], argv: Sequence[str]) -> list[str]:
    """``argv`` run through a shell that first moves itself into each cgroup (``cgroup.procs`` files), then execs.

    The pid stays the same through ``exec``, so the command and all its children are inside the groups from their
    first instruction. When a write fails the wrapper prints one line and exits with 125 without running ``argv``.
    """
    if not procs_files:
        return list(argv)
    writes = " && ".join(f"echo $$ > {shlex.quote(path)}" for path in procs_files)
    script = (
        f'{{ {writes}; }} 2>/dev/null || {{ echo "$0: cannot join the node cgroup ({procs_files[0]})" >&2;'
        f' exit {JOIN_FAILED_EXIT_CODE}; }}; exec "$@"'
    )
    return ["sh", "-c", script, "lhtb-join", *argv]


def view_command(layout: CgroupLayout, argv: Sequence[str]) -> list[str]:
    """``argv`` run through a shell that first mounts ``layout``'s hierarchies again, inside the node namespace.

    ``ip netns exec`` gives the command a private mount namespace with a fresh ``/sys``, which hides
    ``/sys/fs/cgroup``: the process would be limited without seeing its limit, unlike on a real machine, where
    ``lightning_hetero.hetero.measure`` reads it. The mounts stay private to the node's processes. A failed mount
    leaves the limits in force and says so in one line.
    """
    paths: dict[Path, set[str]] = {}
    for controller, path in layout.bases.items():
        paths.setdefault(path, set()).add(controller)
    mounts = []
    for path, controllers in paths.items():
        target = shlex.quote(str(path))
        if layout.version == 2:
            mounts.append(f"mkdir -p {target} && mount -t cgroup2 none {target}")
        else:
            options = ",".join(sorted(controllers - {"unified"}))
            mounts.append(f"mkdir -p {target} && mount -t cgroup -o {options} cgroup {target}")
    roots = {str(path.parent) for path in paths if layout.version == 1}
    prepare = " && ".join(f"mount -t tmpfs lhtb-cgroups {shlex.quote(root)}" for root in sorted(roots))
    script = " && ".join([*([prepare] if prepare else []), *mounts])
    script = f'{{ {script}; }} 2>/dev/null || echo "$0: node cgroup not visible inside the namespace" >&2; exec "$@"'
    return ["sh", "-c", script, "lhtb-view", *argv]


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as handle:
            handle.write(value)
    except OSError as error:
        raise TestbedError(f"cannot write {value!r} to {path}: {error.strerror or error}") from None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_keyed(path: Path) -> dict[str, int]:
    """A ``key value`` per line file (``cpu.stat``, ``memory.events``, ``memory.oom_control``)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split() for line in lines)
    return {parts[0]: int(parts[1]) for parts in pairs if len(parts) == 2 and parts[1].lstrip("-").isdigit()}


@dataclass
class NodeCgroup:
    """One node's group: its name, its directory in each hierarchy, and its limits."""

    node: int
    name: str
    version: int
    directories: dict[str, Path]  # same keys as CgroupLayout.bases
    limits: NodeLimits

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` file of each distinct directory: a process joins the node by writing to all."""
        return [str(directory / "cgroup.procs") for directory in dict.fromkeys(self.directories.values())]

    def members(self) -> list[int]:
        """Pids in the group (in any of its hierarchies)."""
        pids: set[int] = set()
        for procs in self.procs_files:
            try:
                pids.update(int(token) for token in Path(procs).read_text().split())
            except OSError:
                continue
        return sorted(pids)

    def usage(self) -> CgroupUsage:
        """Read the group's CPU time, throttling, memory peak and OOM counters."""
        if self.version == 2:
            directory = self.directories["unified"]
            cpu = _read_keyed(directory / "cpu.stat")
            events = _read_keyed(directory / "memory.events")
            return CgroupUsage(
                cpu_seconds=cpu["usage_usec"] / 1e6 if "usage_usec" in cpu else None,
                cpu_throttled_periods=cpu.get("nr_throttled"),
                cpu_throttled_seconds=cpu["throttled_usec"] / 1e6 if "throttled_usec" in cpu else None,
                memory_peak_bytes=_read_int(directory / "memory.peak"),
                memory_limit_hits=events.get("max"),
                oom_kills=events.get("oom_kill"),
            )
        accounting, cpu_dir, memory = (self.directories.get(key) for key in ("cpuacct", "cpu", "memory"))
        nanoseconds = _read_int(accounting / "cpuacct.usage") if accounting else None
        cpu = _read_keyed(cpu_dir / "cpu.stat") if cpu_dir else {}
        oom = _read_keyed(memory / "memory.oom_control") if memory else {}
        return CgroupUsage(
            cpu_seconds=nanoseconds / 1e9 if nanoseconds is not None else None,
            cpu_throttled_periods=cpu.get("nr_throttled"),
            cpu_throttled_seconds=cpu["throttled_time"] / 1e9 if "throttled_time" in cpu else None,
            memory_peak_bytes=_read_int(memory / "memory.max_usage_in_bytes") if memory else None,
            memory_limit_hits=_read_int(memory / "memory.failcnt") if memory else None,
            oom_kills=oom.get("oom_kill"),
        )

    def reset_peak(self) -> None:
        """Restart the v1 peak at the current usage (v2's ``memory.peak`` keeps counting since creation)."""
        memory = self.directories.get("memory")
        if self.version == 1 and memory is not None:
            try:
                _write(memory / "memory.max_usage_in_bytes", "0")
            except TestbedError:
                pass  # only a statistic


def _apply_limits(group: NodeCgroup) -> None:
    cpu_quota, memory_limit = group.limits.cpu_quota, group.limits.memory_limit_bytes
    if group.version == 2:
        directory = group.directories["unified"]
        if cpu_quota is not None:
            _write(directory / "cpu.max", f"{round(cpu_quota * CPU_PERIOD_MICROSECONDS)} {CPU_PERIOD_MICROSECONDS}")
            _write(directory / "cpu.weight", str(min(10_000, max(1, round(_WEIGHT_PER_CORE * cpu_quota)))))
        if memory_limit is not None:
            _write(directory / "memory.max", str(memory_limit))
            if (directory / "memory.swap.max").exists():  # absent without swap accounting: nothing to dodge into
                _write(directory / "memory.swap.max", "0")
        return
    if cpu_quota is not None:
        directory = group.directories["cpu"]
        _write(directory / "cpu.cfs_period_us", str(CPU_PERIOD_MICROSECONDS))
        _write(directory / "cpu.cfs_quota_us", str(round(cpu_quota * CPU_PERIOD_MICROSECONDS)))
        _write(directory / "cpu.shares", str(min(262_144, max(2, round(_SHARES_PER_CORE * cpu_quota)))))
    if memory_limit is not None:
        directory = group.directories["memory"]
        _write(directory / "memory.limit_in_bytes", str(memory_limit))  # first: memsw may never be below it
        if (directory / "memory.memsw.limit_in_bytes").exists():
            _write(directory / "memory.memsw.limit_in_bytes", str(memory_limit))


def _enable_v2_controllers(root: Path, controllers: Collection[str]) -> None:
    """Children of the v2 root get only the controllers listed in its ``cgroup.subtree_control``."""
    enabled = set((root / "cgroup.subtree_control").read_text().split())
    missing = [name for name in sorted(controllers) if name not in enabled]
    if missing:
        _write(root / "cgroup.subtree_control", " ".join(f"+{name}" for name in missing))


@dataclass
class RunCgroups:
    """The node groups of one run (made by :func:`create_node_cgroups`)."""

    run_id: str
    layout: CgroupLayout
    groups: list[NodeCgroup] = field(default_factory=list)

    def procs_files(self, node: int) -> list[str]:
        """The ``cgroup.procs`` files a process of ``node`` writes its pid to."""
        return self.groups[node].procs_files

    def usage(self) -> list[CgroupUsage]:
        """Every node's counters, indexed by node."""
        return [group.usage() for group in self.groups]

    def remove(self) -> list[str]:
        """Kill what is left in the groups and remove them; returns the directories removed. Idempotent."""
        removed = []
        for group in reversed(self.groups):
            removed.extend(_remove_group(group.name, list(dict.fromkeys(group.directories.values()))))
        self.groups.clear()
        return removed


def create_node_cgroups(run_id: str, limits: Sequence[NodeLimits], layout: CgroupLayout) -> RunCgroups:
    """Make ``lhtb-<run_id>-n<k>`` in every hierarchy of ``layout`` for each node and write its limits.

    On any failure the groups made so far are removed before the error propagates.

    Raises:
        TestbedError: A directory or control file could not be written (the path and reason are in the message).
    """
    run = RunCgroups(run_id, layout)
    try:
        if layout.version == 2:
            controllers = {"cpu"} if any(limit.cpu_quota is not None for limit in limits) else set()
            controllers |= {"memory"} if any(limit.memory_limit_bytes is not None for limit in limits) else set()
            _enable_v2_controllers(layout.bases["unified"], controllers)
        for node, node_limits in enumerate(limits):
            name = f"{NAME_PREFIX}{run_id}-n{node}"
            directories = {key: base / name for key, base in layout.bases.items()}
            group = NodeCgroup(node, name, layout.version, {}, node_limits)
            run.groups.append(group)
            for key, directory in directories.items():
                if directory not in group.directories.values():
                    try:
                        _make_group_directory(directory)
                    except OSError as error:
                        raise TestbedError(f"cannot create cgroup {directory}: {error.strerror or error}") from None
                group.directories[key] = directory
            _apply_limits(group)
    except BaseException:
        run.remove()
        raise
    return run


def _kill_members(procs_files: Sequence[Path]) -> list[int]:
    """SIGKILL every process in the groups until they are empty (or a few seconds passed); returns the pids seen."""
    seen: set[int] = set()
    deadline = time.monotonic() + _REMOVE_WAIT_SECONDS
    while True:
        pids: set[int] = set()
        for procs in procs_files:
            try:
                pids.update(int(token) for token in procs.read_text().split())
            except (OSError, ValueError):
                continue
        if not pids or time.monotonic() > deadline:
            return sorted(seen)
        seen |= pids
        for pid in pids:  # again each round: a member may have forked meanwhile
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def _remove_group(name: str, directories: Sequence[Path]) -> list[str]:
    _kill_members([directory / "cgroup.procs" for directory in directories if directory.exists()])
    removed = []
    for directory in directories:
        deadline = time.monotonic() + _REMOVE_WAIT_SECONDS
        while directory.exists():
            try:
                _remove_group_directory(directory)
                removed.append(str(directory))
            except OSError:  # EBUSY while a killed member is still exiting: retry briefly
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    return removed


def list_testbed_cgroups(mounts: Sequence[CgroupMount] | None = None) -> list[Path]:
    """Every ``lhtb-*`` group directory at the root of a hierarchy the testbed uses (any run, live or dead)."""
    mounts = read_cgroup_mounts() if mounts is None else mounts
    found = []
    for mount in mounts:
        if mount.version == 1 and not mount.controllers & {"cpu", "cpuacct", "memory"}:
            continue
        try:
            children = sorted(mount.path.iterdir())
        except OSError:
            continue
        found.extend(child for child in children if child.is_dir() and child.name.startswith(NAME_PREFIX))
    return found


def cleanup_leftover_cgroups(
    log: Callable[[str], None] | None = None, mounts: Sequence[CgroupMount] | None = None
) -> list[str]:
    """Remove ``lhtb-*`` groups of runs whose testbed is gone (killing what still runs in them); keep live runs'.

    Returns:
        The group directories removed.
    """
    say = log or (lambda line: None)
    removed: list[str] = []
    by_name: dict[str, list[Path]] = {}
    for directory in list_testbed_cgroups(mounts):
        by_name.setdefault(directory.name, []).append(directory)
    for name, directories in sorted(by_name.items()):
        match = _GROUP_PATTERN.match(name)
        owner = run_owner_pid(match["run_id"]) if match else None
        if owner is not None:
            say(f"kept cgroup {name}: its testbed (pid {owner}) is still running")
            continue
        killed = _kill_members([directory / "cgroup.procs" for directory in directories])
        if killed:
            say(f"killed {len(killed)} leftover process(es) in cgroup {name}: {' '.join(map(str, killed))}")
        for path in _remove_group(name, directories):
            removed.append(path)
            say(f"removed cgroup {path}")
    return removed


def omp_threads_for_quota(cpu_quota: float, processes: int = 1) -> int:
    """Threads per process for a node with ``cpu_quota`` cores shared by ``processes``: ceil of the share, >= 1."""
    return max(1, math.ceil(cpu_quota / processes - 1e-9))
