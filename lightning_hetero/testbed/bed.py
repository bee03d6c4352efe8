"""The :class:`Testbed` context manager: build the namespaces, run commands in them, report, always tear down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from lightning_hetero.comm.dump import load_ledger_dumps
from lightning_hetero.testbed.cgroups import (
    CgroupUsage,
    NodeLimits,
    RunCgroups,
    create_node_cgroups,
    join_command,
    select_layout,
)
from lightning_hetero.testbed.checks import (
    PerNode,
    TestbedConfigError,
    check_environment,
    parse_latency,
    parse_node_cpu,
    parse_node_memory,
    parse_rate,
    validate_layout,
)
from lightning_hetero.testbed.launch import LAUNCH_MODES, build_process_specs, run_processes
from lightning_hetero.testbed.netns import (
    NODE_INTERFACE,
    InterfaceCounters,
    Topology,
    create_topology,
    read_counters,
    teardown,
)
from lightning_hetero.testbed.report import build_report, node_resources, write_report
from lightning_hetero.testbed.shaping import TbfParameters, tbf_parameters

__all__ = ["RunResult", "Testbed", "TestbedInterrupted"]

_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class TestbedInterrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived while a :class:`Testbed` was open; it has cleaned up.

    A ``BaseException`` like ``KeyboardInterrupt``, so ``except Exception`` in user code does not swallow it.
    """

    __test__ = False

    def __init__(self, signo: int) -> None:
        self.signo = signo
        super().__init__(f"interrupted by {signal.Signals(signo).name}")

    @property
    def exit_code(self) -> int:
        """The conventional exit code: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signo


@dataclass
class RunResult:
    """What :meth:`Testbed.run` returns."""

    exit_code: int
    report: dict[str, Any]
    report_path: Path


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux; the testbed refuses to run there anyway
        return os.cpu_count() or 1


class Testbed:
    """Nodes as network namespaces on one machine, joined through a bridge by shaped veth links.

    Example::

        with Testbed(nodes=2, ranks_per_node=1, bandwidth="100mbit") as bed:
            result = bed.run(["python", "train.py"], timeout=600)
        print(result.exit_code, result.report["nodes"][0]["wire"])

    Args:
        nodes: Number of nodes (namespaces).
        ranks_per_node: Processes per node (``per-rank`` launch) or ``NPROC_PER_NODE`` (``per-node``).
        bandwidth: Rate of every node's link, each direction (``tc`` syntax: ``"100mbit"``; ``"10mbps"`` is BYTES/s),
            or None/``"none"`` for an unshaped link.
        latency: One-way delay added on every node's uplink (``"20ms"``), needs the netem qdisc; None for none.
        run_dir: Folder for ledger dumps and the default report (default: a fresh ``/tmp/lhtb-run-*``).
        master_port: ``MASTER_PORT`` on node 0 (namespaces have their own ports, so 29500 never clashes).
        node_cpu: Each node's CPU quota in cores (``[1.0, 0.5]``, ``"1.0,0.5"``, or one value for all; None or
            ``"none"`` for an unlimited node), enforced by a per-node cgroup.
        node_memory: Each node's memory limit (``["6G", "1.5Gi"]``, bytes as int, or one value for all; None or
            ``"none"`` for unlimited); past it the kernel OOM-kills inside the node.
        log: Where the testbed's own ``[testbed]`` lines go (default: stderr).

    Raises:
        TestbedConfigError: Bad arguments (at construction) or an unusable machine (on ``__enter__``).
    """

    __test__ = False

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int = 1,
        bandwidth: str | float | None = None,
        latency: str | float | None = None,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        master_port: int = 29500,
        node_cpu: PerNode | Sequence[PerNode] = None,
        node_memory: PerNode | Sequence[PerNode] = None,
        log: TextIO | None = None,
    ) -> None:
        validate_layout(nodes, ranks_per_node, master_port)
        self.node_cpu = parse_node_cpu(node_cpu, nodes)
        self.node_memory = parse_node_memory(node_memory, nodes)
        self._cgroup_controllers = [
            name for name, limits in (("cpu", self.node_cpu), ("memory", self.node_memory)) if limits is not None
        ]
        self._cgroups: RunCgroups | None = None
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.bandwidth = None if bandwidth is None else str(bandwidth)
        self.bits_per_second = parse_rate(bandwidth)
        self.latency = None if latency is None else str(latency)
        self.latency_seconds = parse_latency(latency)
        self.tbf: TbfParameters | None = tbf_parameters(self.bits_per_second) if self.bits_per_second else None
        self.master_port = master_port
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self._log_stream = log
        self._topology: Topology | None = None
        self._runs = 0
        self._saved_handlers: dict[int, Any] = {}

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        check_environment(need_netem=self.latency_seconds is not None, cgroup_controllers=self._cgroup_controllers)
        self._install_signal_handlers()
        pending: list[int] = []
        try:
            if self._run_dir is None:
                self._run_dir = Path(tempfile.mkdtemp(prefix="lhtb-run-"))
            self._run_dir.mkdir(parents=True, exist_ok=True)
            with _deferred_signals(pending):  # a half-built topology is removed by create_topology itself
                self._topology = create_topology(self.nodes, self.tbf, self.latency_seconds)
                self._create_cgroups()
        except BaseException:
            self._restore_signal_handlers()
            raise
        if pending:
            self.close()
            raise TestbedInterrupted(pending[0])
        shaping = f"{self.bandwidth} per direction" if self.tbf else "unshaped"
        if self.tbf:
            shaping += f" (tbf burst {self.tbf.burst_bytes} B, queue limit {self.tbf.limit_bytes} B)"
        self._log(
            f"run {self.run_id}: {self.nodes} node(s) x {self.ranks_per_node} rank(s), links {shaping}"
            + (f", +{self.latency} one-way delay" if self.latency else "")
            + f"; run dir {self._run_dir}"
        )
        if self._cgroups is not None:
            self._log(f"node cgroups (v{self._cgroups.layout.version}): {_limits_text(self.node_limits)}")
        return self

    def _create_cgroups(self) -> None:
        """The nodes' cgroups, after the namespaces (whose state file marks the run id as live for --cleanup)."""
        if not self._cgroup_controllers:
            return
        try:
            layout = select_layout(self._cgroup_controllers)
            self._cgroups = create_node_cgroups(self.run_id, self.node_limits, layout)
        except BaseException:
            assert self._topology is not None
            teardown(self._topology)
            self._topology = None
            raise

    @property
    def node_limits(self) -> list[NodeLimits]:
        """Each node's CPU quota and memory limit (None fields: unlimited)."""
        cpu = self.node_cpu or [None] * self.nodes
        memory = self.node_memory or [None] * self.nodes
        return [NodeLimits(quota, limit) for quota, limit in zip(cpu, memory, strict=True)]

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every cgroup and namespace of this testbed (signals are deferred meanwhile); idempotent."""
        if self._topology is None:
            self._restore_signal_handlers()
            return
        pending: list[int] = []
        with _deferred_signals(pending):
            groups = self._cgroups.remove() if self._cgroups is not None else []  # kills what is left inside
            self._cgroups = None
            removed = teardown(self._topology)
            self._topology = None
        self._log(f"removed {len(removed)} namespace(s)" + (f" and {len(groups)} cgroup(s)" if groups else ""))
        self._restore_signal_handlers()
        if pending and threading.current_thread() is threading.main_thread():
            raise TestbedInterrupted(pending[0])

    # -- queries -----------------------------------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        """The live topology (only inside the ``with`` block)."""
        if self._topology is None:
            raise RuntimeError("the testbed is not open; use it as 'with Testbed(...) as bed:'.")
        return self._topology

    @property
    def run_id(self) -> str:
        """The 6-hex-digit id in every namespace name (``lhtb-<id>-n0``)."""
        return self.topology.run_id

    @property
    def run_dir(self) -> Path:
        """Folder for ledger dumps and reports."""
        assert self._run_dir is not None
        return self._run_dir

    def namespace(self, node: int) -> str:
        """Name of node ``node``'s namespace."""
        return self.topology.node_namespaces[node]

    def node_address(self, node: int) -> str:
        """IPv4 address of node ``node`` on its ``eth0``; node 0's is ``MASTER_ADDR``."""
        return self.topology.node_addresses[node]

    def counters(self) -> list[InterfaceCounters]:
        """Current byte/packet counters of every node's ``eth0``, indexed by node."""
        return [read_counters(namespace, NODE_INTERFACE) for namespace in self.topology.node_namespaces]

    @property
    def cgroups(self) -> RunCgroups | None:
        """The nodes' cgroups (None without ``node_cpu``/``node_memory``); only inside the ``with`` block."""
        return self._cgroups

    def popen(self, node: int, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside node ``node``'s namespace and cgroup (no testbed environment); teardown kills it."""
        procs = self._cgroups.procs_files(node) if self._cgroups is not None else []
        return subprocess.Popen(
            join_command(procs, ["ip", "netns", "exec", self.namespace(node), *argv]), **popen_kwargs
        )

    # -- running -----------------------------------------------------------------------------------------------
    def run(
        self,
        command: Sequence[str],
        *,
        launch: str = "per-rank",
        timeout: float | None = None,
        report_path: str | os.PathLike[str] | None = None,
        output: TextIO | None = None,
        failure_grace: float = 5.0,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Run ``command`` on every node (or rank), wait, read the counters and ledgers, write the report.

        Args:
            command: The argv, e.g. ``["python", "train.py"]`` (no shell; use ``["bash", "-c", "..."]`` for one).
            launch: ``"per-rank"`` or ``"per-node"`` (see :mod:`lightning_hetero.testbed.launch`).
            timeout: Seconds before every process is stopped; the exit code is then 124.
            report_path: Where the JSON report goes (default ``<run dir>/report.json``, then ``report-2.json``...).
            output: Stream for the prefixed output lines (default: stdout).
            failure_grace: Seconds the others get after the first failure before they are stopped.
            env: Base environment (default: this process's); launcher variables in it are replaced.

        Returns:
            The exit code, the report dict and where it was written.

        Raises:
            TestbedConfigError: Empty command or unknown launch mode.
            TestbedInterrupted: A signal arrived; every process was stopped (the namespaces go on ``__exit__``).
        """
        if not command:
            raise TestbedConfigError("no command given; put it after '--', e.g. ... -- python train.py")
        if launch not in LAUNCH_MODES:
            raise TestbedConfigError(f"--launch {launch!r} is unknown; use one of {', '.join(LAUNCH_MODES)}.")
        topology = self.topology
        self._runs += 1
        suffix = "" if self._runs == 1 else f"-{self._runs}"
        ledger_dir = self.run_dir / f"ledger{suffix}"
        ledger_dir.mkdir(parents=True, exist_ok=True)
        specs = build_process_specs(
            command,
            launch=launch,
            namespaces=topology.node_namespaces,
            ranks_per_node=self.ranks_per_node,
            master_addr=topology.node_addresses[0],
            master_port=self.master_port,
            ledger_dir=str(ledger_dir),
            run_id=topology.run_id,
            base_env=os.environ if env is None else env,
            cpu_count=_usable_cpus(),
            node_cpu=self.node_cpu,
            node_cgroup_procs=[self._cgroups.procs_files(node) for node in range(self.nodes)]
            if self._cgroups
            else None,
            cgroup_layout=self._cgroups.layout if self._cgroups else None,
        )
        usage_before = self._cgroup_usage(reset_peaks=True)
        before = self.counters()
        outcome = run_processes(
            specs,
            output=output or sys.stdout,
            timeout=timeout,
            failure_grace=failure_grace,
            log=self._log,
        )
        after = self.counters()
        usage_after = self._cgroup_usage()
        report = build_report(
            run_id=topology.run_id,
            config=self._config(command, launch, timeout),
            node_addresses=topology.node_addresses,
            counters_before=before,
            counters_after=after,
            ledger_dumps=load_ledger_dumps(ledger_dir),
            processes=[process.to_dict() for process in outcome.processes],
            exit_code=outcome.exit_code,
            timed_out=outcome.timed_out,
            elapsed_seconds=outcome.elapsed_seconds,
            run_dir=str(self.run_dir),
            ledger_dir=str(ledger_dir),
            resources=self._resources(usage_before, usage_after),
        )
        path = write_report(report, report_path or self.run_dir / f"report{suffix}.json")
        self._log(_summary(report, path))
        return RunResult(exit_code=outcome.exit_code, report=report, report_path=path)

    def _cgroup_usage(self, *, reset_peaks: bool = False) -> list[CgroupUsage] | None:
        if self._cgroups is None:
            return None
        if reset_peaks:
            for group in self._cgroups.groups:
                group.reset_peak()
        return self._cgroups.usage()

    def _resources(self, before: list[CgroupUsage] | None, after: list[CgroupUsage] | None) -> list[dict[str, Any]]:
        """Each node's limits for the report, with what its cgroup counted during the run."""
        entries = []
        for node, limits in enumerate(self.node_limits):
            cgroup: dict[str, Any] = {}
            if self._cgroups is not None and before is not None and after is not None:
                group = self._cgroups.groups[node]
                usage = after[node].since(before[node]).to_dict()
                cgroup = {"cgroup_version": group.version, "cgroup_name": group.name, "usage": usage}
            entries.append(
                node_resources(cpu_quota=limits.cpu_quota, memory_limit_bytes=limits.memory_limit_bytes, **cgroup)
            )
        return entries

    def _config(self, command: Sequence[str], launch: str, timeout: float | None) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "bandwidth": self.bandwidth,
            "bits_per_second": self.bits_per_second,
            "latency": self.latency,
            "latency_seconds": self.latency_seconds,
            "tbf": self.tbf.to_dict() if self.tbf else None,
            "launch": launch,
            "command": list(command),
            "master_addr": self.topology.node_addresses[0],
            "master_port": self.master_port,
            "timeout": timeout,
            "interface": NODE_INTERFACE,
            "node_cpu": self.node_cpu,
            "node_memory": self.node_memory,
            "cgroup_version": self._cgroups.layout.version if self._cgroups is not None else None,
        }

    # -- signals and logging -----------------------------------------------------------------------------------
    def _log(self, line: str) -> None:
        stream = self._log_stream or sys.stderr
        stream.write(f"[testbed] {line}\n")
        stream.flush()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; Ctrl-C still raises KeyboardInterrupt there

        def interrupt(signo: int, frame: FrameType | None) -> None:
            raise TestbedInterrupted(signo)

        for signo in _HANDLED_SIGNALS:
            self._saved_handlers[signo] = signal.signal(signo, interrupt)

    def _restore_signal_handlers(self) -> None:
        for signo, handler in self._saved_handlers.items():
            signal.signal(signo, handler)
        self._saved_handlers.clear()


@contextmanager
def _deferred_signals(pending: list[int]) -> Iterator[None]:
    """Record (instead of raising) the handled signals inside the block, so teardown cannot be cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signo: signal.signal(signo, lambda signo, frame: pending.append(signo)) for signo in _HANDLED_SIGNALS}
    try:
        yield
    finally:
        for signo, handler in previous.items():
            signal.signal(signo, handler)


def _limits_text(limits: Sequence[NodeLimits]) -> str:
    parts = []
    for node, limit in enumerate(limits):
        cpu = "unlimited cpu" if limit.cpu_quota is None else f"{limit.cpu_quota:g} cpu"
        memory = "unlimited memory" if limit.memory_limit_bytes is None else f"{limit.memory_limit_bytes} B memory"
        parts.append(f"n{node} {cpu}, {memory}")
    return "; ".join(parts)


def _summary(report: Mapping[str, Any], path: Path) -> str:
    parts = []
    for node in report["nodes"]:
        wire, ratio = node["wire"], node["wire_over_ledger"]
        text = f"n{node['node']} wire tx {wire['tx_bytes']} B rx {wire['rx_bytes']} B"
        if ratio and ratio["tx_over_sent"] is not None:
            text += f" (x{ratio['tx_over_sent']:.3f} of ledger sent)"
        cgroup = node.get("cgroup")
        if cgroup and cgroup.get("cpu_seconds") is not None:
            text += f", cpu {cgroup['cpu_seconds']:.1f} s"
        if cgroup and cgroup.get("oom_kills"):
            text += f", {cgroup['oom_kills']} OOM kill(s)"
        parts.append(text)
    return f"exit code {report['exit_code']} after {report['elapsed_seconds']:.1f} s; {'; '.join(parts)}; report {path}"
