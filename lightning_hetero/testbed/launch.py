"""Start the command in every node namespace, stream its output with a prefix, and stop everything on failure.

Two launch modes:

- ``per-rank`` (default): the testbed starts ``ranks_per_node`` processes per node itself, each with the full
  torchrun-style environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``,
  ``TORCHELASTIC_RUN_ID`` ...), so Lightning sees a torchelastic launch and does not spawn ranks itself.
- ``per-node``: one process per node with only node-level variables (``NODE_RANK``, ``NNODES``,
  ``NPROC_PER_NODE``, ``MASTER_ADDR``, ``MASTER_PORT``), meant for ``torchrun`` (wrap it in ``bash -c '...'`` so the
  ``$VARS`` expand inside the namespace).

Every process runs in its own session (so a terminal Ctrl-C reaches only the testbed, which then stops them in
order) and is stopped by process group, which also catches torchrun's children.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from lightning_hetero.comm.dump import LEDGER_DIR_ENV
from lightning_hetero.testbed.cgroups import CgroupLayout, join_command, omp_threads_for_quota, view_command
from lightning_hetero.testbed.netns import NODE_INTERFACE

__all__ = [
    "LAUNCH_MODES",
    "TIMEOUT_EXIT_CODE",
    "LaunchOutcome",
    "ProcessOutcome",
    "ProcessSpec",
    "build_process_specs",
    "exit_status",
    "node_environment",
    "rank_environment",
    "run_processes",
    "worst_exit_code",
]

LAUNCH_MODES = ("per-rank", "per-node")
TIMEOUT_EXIT_CODE = 124  # as coreutils' timeout(1)
_POLL_SECONDS = 0.05
_KILL_GRACE_SECONDS = 3.0
_READER_JOIN_SECONDS = 2.0

#: Launcher variables of the caller's own environment that must not leak into the namespaces (they would describe
#: the caller's job, not the testbed's).
_REPLACED_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "NODE_RANK",
        "NNODES",
        "NPROC_PER_NODE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
_REPLACED_PREFIXES = ("TORCHELASTIC_", "SLURM_")


def _inherited(base_env: Mapping[str, str]) -> dict[str, str]:
    return {
        key: value
        for key, value in base_env.items()
        if key not in _REPLACED_VARIABLES and not key.startswith(_REPLACED_PREFIXES)
    }


def node_environment(
    base_env: Mapping[str, str],
    *,
    nodes: int,
    ranks_per_node: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    ledger_dir: str,
    cpu_count: int,
    cpu_quota: float | None = None,
) -> dict[str, str]:
    """The environment of one node's process in ``per-node`` mode (for torchrun); see :func:`rank_environment`."""
    env = _inherited(base_env)
    env.update(
        {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "NODE_RANK": str(node_rank),
            "NNODES": str(nodes),
            # The hostname does not resolve inside a namespace: gloo must pick its address from the interface.
            "GLOO_SOCKET_IFNAME": NODE_INTERFACE,
            LEDGER_DIR_ENV: ledger_dir,
            "PYTHONUNBUFFERED": "1",
            "NPROC_PER_NODE": str(ranks_per_node),
        }
    )
    # All "nodes" share this machine's cores: one intra-op pool per rank sized to its share avoids oversubscription.
    # A node with a CPU quota has its own share: more threads than its cores would only queue on the throttle.
    if cpu_quota is not None:
        threads = omp_threads_for_quota(cpu_quota, ranks_per_node)
    else:
        threads = max(1, cpu_count // (nodes * ranks_per_node))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def rank_environment(
    base_env: Mapping[str, str],
    *,
    nodes: int,
    ranks_per_node: int,
    node_rank: int,
    local_rank: int,
    master_addr: str,
    master_port: int,
    ledger_dir: str,
    run_id: str,
    cpu_count: int,
    cpu_quota: float | None = None,
) -> dict[str, str]:
    """The environment of one rank in ``per-rank`` mode.

    Args:
        base_env: The caller's environment; kept except for launcher variables, which are replaced.
        nodes: Number of nodes.
        ranks_per_node: Processes per node.
        node_rank: This rank's node (0-based).
        local_rank: This rank's index inside its node.
        master_addr: Node 0's address.
        master_port: The rendezvous port on node 0.
        ledger_dir: Where ``lightning_hetero.comm`` dumps the ledger at exit.
        run_id: The testbed run id (becomes ``TORCHELASTIC_RUN_ID=lhtb-<id>``).
        cpu_count: CPUs available to the whole testbed (sets the default ``OMP_NUM_THREADS``).
        cpu_quota: The node's CPU quota in cores (``--node-cpu``); when set, the default ``OMP_NUM_THREADS`` is
            ``ceil(cpu_quota / ranks_per_node)``, at least 1, instead of this machine's share.

    Returns:
        A new dict: ``base_env`` minus launcher variables, plus the topology variables.
    """
    # The node's environment minus torchrun's NPROC_PER_NODE (here the testbed starts every rank itself).
    run_wide = dict(master_addr=master_addr, master_port=master_port, ledger_dir=ledger_dir, cpu_count=cpu_count)
    run_wide["cpu_quota"] = cpu_quota
    env = node_environment(base_env, nodes=nodes, ranks_per_node=ranks_per_node, node_rank=node_rank, **run_wide)
    del env["NPROC_PER_NODE"]
    env.update(
        {
            "WORLD_SIZE": str(nodes * ranks_per_node),
            "RANK": str(node_rank * ranks_per_node + local_rank),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(ranks_per_node),
            "GROUP_RANK": str(node_rank),
            # torch.distributed.is_torchelastic_launched() (and so Lightning's TorchElasticEnvironment) keys on it.
            "TORCHELASTIC_RUN_ID": f"lhtb-{run_id}",
        }
    )
    return env


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: where, with what, and how its output lines are prefixed."""

    name: str  # "n<k>r<rank>" or "n<k>"
    node: int
    rank: int | None
    local_rank: int | None
    namespace: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    #: ``cgroup.procs`` files of the node's cgroup (``--node-cpu``/``--node-memory``); empty: no cgroup.
    cgroup_procs: tuple[str, ...] = ()
    #: The run's cgroup hierarchies, mounted again inside the namespace so the process can read its own limits.
    cgroup_layout: CgroupLayout | None = None

    @property
    def argv(self) -> list[str]:
        """The full argv: the command run through ``ip netns exec`` (which execs it, so the pid is the command's).

        With a node cgroup, a shell wrapper joins it first and then execs ``ip netns exec``: the pid stays the
        command's, and the command starts inside its node's limits. Inside the namespace a second wrapper mounts the
        cgroup hierarchies again (``view_command``), so the command sees its own group as on a real machine.
        """
        command = view_command(self.cgroup_layout, self.command) if self.cgroup_layout else list(self.command)
        return join_command(self.cgroup_procs, ["ip", "netns", "exec", self.namespace, *command])


def build_process_specs(
    command: Sequence[str],
    *,
    launch: str,
    namespaces: Sequence[str],
    ranks_per_node: int,
    master_addr: str,
    master_port: int,
    ledger_dir: str,
    run_id: str,
    base_env: Mapping[str, str],
    cpu_count: int,
    node_cpu: Sequence[float | None] | None = None,
    node_cgroup_procs: Sequence[Sequence[str]] | None = None,
    cgroup_layout: CgroupLayout | None = None,
) -> list[ProcessSpec]:
    """Every process of one run, ordered by node then local rank.

    ``node_cpu`` (each node's CPU quota, sets ``OMP_NUM_THREADS``) and ``node_cgroup_procs`` (each node's
    ``cgroup.procs`` files) are per node; None means no cgroups. ``cgroup_layout``: the hierarchies to show inside
    the namespaces.
    """
    if launch not in LAUNCH_MODES:
        raise ValueError(f"launch must be one of {LAUNCH_MODES}, got {launch!r}.")
    nodes = len(namespaces)
    topology = {"nodes": nodes, "ranks_per_node": ranks_per_node, "master_addr": master_addr}
    topology |= {"master_port": master_port, "ledger_dir": ledger_dir, "cpu_count": cpu_count}
    specs = []
    for node, namespace in enumerate(namespaces):
        quota = node_cpu[node] if node_cpu is not None else None
        procs = tuple(node_cgroup_procs[node]) if node_cgroup_procs is not None else ()
        view = cgroup_layout if procs else None
        if launch == "per-node":
            env = node_environment(base_env, node_rank=node, cpu_quota=quota, **topology)
            specs.append(ProcessSpec(f"n{node}", node, None, None, namespace, tuple(command), env, procs, view))
            continue
        for local in range(ranks_per_node):
            env = rank_environment(
                base_env, node_rank=node, local_rank=local, run_id=run_id, cpu_quota=quota, **topology
            )
            rank = node * ranks_per_node + local
            specs.append(ProcessSpec(f"n{node}r{rank}", node, rank, local, namespace, tuple(command), env, procs, view))
    return specs


def exit_status(returncode: int) -> int:
    """A shell-style exit status: a death by signal N (Popen's ``-N``) becomes ``128 + N``."""
    return 128 - returncode if returncode < 0 else returncode


def worst_exit_code(statuses: Sequence[int]) -> int:
    """0 when every status is 0, else the largest non-zero status (a crash by signal outranks a plain error)."""
    return max((status for status in statuses if status != 0), default=0)


@dataclass
class ProcessOutcome:
    """How one process ended."""

    name: str
    node: int
    rank: int | None
    local_rank: int | None
    pid: int
    returncode: int | None = None
    exit_status: int | None = None
    stopped_by_testbed: bool = False  # terminated after another process failed, on timeout, or on a signal
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)


@dataclass
class LaunchOutcome:
    """The result of :func:`run_processes`."""

    exit_code: int
    timed_out: bool
    elapsed_seconds: float
    processes: list[ProcessOutcome] = field(default_factory=list)


def _stream(pipe: Any, prefix: str, output: TextIO, lock: threading.Lock) -> None:
    """Copy ``pipe`` line by line to ``output`` with ``prefix``; runs in a reader thread until EOF."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with lock:
                output.write(f"{prefix}{line}\n")
                output.flush()


def _signal_group(process: subprocess.Popen[bytes], signo: int) -> None:
    try:
        os.killpg(process.pid, signo)  # start_new_session=True: the process leads its own group
    except (ProcessLookupError, PermissionError):
        pass


def _stop(processes: list[subprocess.Popen[bytes]], outcomes: list[ProcessOutcome], grace: float) -> None:
    """SIGTERM every running process group, SIGKILL what is left after ``grace`` seconds, reap everything."""
    running = [(p, o) for p, o in zip(processes, outcomes, strict=True) if p.poll() is None]
    for process, outcome in running:
        outcome.stopped_by_testbed = True
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p, _ in running) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    for process, _ in running:
        _signal_group(process, signal.SIGKILL)  # the group: also children that outlived a terminated leader
        process.wait()


def run_processes(
    specs: Sequence[ProcessSpec],
    *,
    output: TextIO,
    timeout: float | None = None,
    failure_grace: float = 5.0,
    log: Callable[[str], None] = lambda line: None,
) -> LaunchOutcome:
    """Start every process, stream its output, wait; stop the rest when one fails or time runs out.

    Args:
        specs: The processes (see :func:`build_process_specs`).
        output: Where prefixed output lines go (written whole, under a lock, flushed per line).
        timeout: Seconds for the whole run; past it every process is stopped and the exit code is 124.
        failure_grace: Seconds the others get to finish (or fail on their own) after the first non-zero exit,
            before they are stopped (they would otherwise hang in a collective).
        log: Receives one line per testbed event (a failure, a timeout).

    Returns:
        The exit code (0; 124 on timeout; else the worst status of the processes that ended on their own), the
        elapsed seconds and each process's outcome.
    """
    lock = threading.Lock()
    processes: list[subprocess.Popen[bytes]] = []
    outcomes: list[ProcessOutcome] = []
    readers: list[threading.Thread] = []
    start = time.monotonic()
    timed_out = False
    try:
        for spec in specs:
            process = subprocess.Popen(
                spec.argv,
                env=dict(spec.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            processes.append(process)
            outcomes.append(ProcessOutcome(spec.name, spec.node, spec.rank, spec.local_rank, process.pid))
            reader = threading.Thread(
                target=_stream, args=(process.stdout, f"[{spec.name}] ", output, lock), daemon=True
            )
            reader.start()
            readers.append(reader)
        first_failure: float | None = None
        while any(outcome.returncode is None for outcome in outcomes):
            now = time.monotonic()
            for process, outcome in zip(processes, outcomes, strict=True):
                if outcome.returncode is None and process.poll() is not None:
                    outcome.returncode = process.returncode
                    outcome.exit_status = exit_status(process.returncode)
                    outcome.seconds = now - start
                    if outcome.exit_status != 0 and first_failure is None:
                        first_failure = now
                        log(
                            f"{outcome.name} exited with {outcome.exit_status}; stopping the others"
                            f" in {failure_grace:g} s unless they finish first"
                        )
            if timeout is not None and now - start > timeout and not timed_out:
                timed_out = True
                log(f"timeout after {timeout:g} s; stopping every process")
                _stop(processes, outcomes, _KILL_GRACE_SECONDS)
            elif first_failure is not None and now - first_failure > failure_grace:
                _stop(processes, outcomes, _KILL_GRACE_SECONDS)
            else:
                time.sleep(_POLL_SECONDS)
            _record_stopped(processes, outcomes, start)
    finally:
        _stop(processes, outcomes, _KILL_GRACE_SECONDS)  # no-op after a normal end; the Ctrl-C/SIGTERM path
        _record_stopped(processes, outcomes, start)
        for reader in readers:
            reader.join(_READER_JOIN_SECONDS)
    elapsed = time.monotonic() - start
    if timed_out:
        code = TIMEOUT_EXIT_CODE
    else:
        code = worst_exit_code([o.exit_status for o in outcomes if not o.stopped_by_testbed and o.exit_status])
    return LaunchOutcome(exit_code=code, timed_out=timed_out, elapsed_seconds=elapsed, processes=outcomes)


def _record_stopped(processes: list[subprocess.Popen[bytes]], outcomes: list[ProcessOutcome], start: float) -> None:
    for process, outcome in zip(processes, outcomes, strict=True):
        if outcome.returncode is None and process.returncode is not None:
            outcome.returncode = process.returncode
            outcome.exit_status = exit_status(process.returncode)
            outcome.seconds = time.monotonic() - start
