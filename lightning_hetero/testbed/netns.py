"""Network namespaces, a bridge, shaped veth links and their byte counters, created and removed with ``ip``/``tc``.

Topology of run ``<id>`` (6 hex digits)::

    lhtb-<id>-n0 [eth0 10.213.0.1/24] ==veth== [lhtb-n0] \\
    lhtb-<id>-n1 [eth0 10.213.0.2/24] ==veth== [lhtb-n1]  +-- lhtb-br (bridge) in lhtb-<id>-sw
    ...                                                    /

Everything lives in namespaces this module created; the root namespace is never touched. Each node's link is
shaped in both directions: a tbf on the node's ``eth0`` (uplink) and one on its switch-side peer (downlink).
Optional delay is a netem qdisc on the uplink with the tbf as its child. Segmentation offload is disabled on every
veth end (``gso_max_segs 1``) so the byte counters see real frames, each with its own headers, as a NIC would.

Ownership: before the first namespace of a run is created, a state file ``/run/lhtb-testbed/<id>.json`` records the
owner's pid and start time. :func:`cleanup_leftovers` removes ``lhtb-*`` namespaces whose owner is gone and keeps
those of a live run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_hetero.testbed.shaping import TbfParameters

__all__ = [
    "NAME_PREFIX",
    "NODE_INTERFACE",
    "STATE_DIR",
    "InterfaceCounters",
    "Topology",
    "TestbedError",
    "cleanup_leftovers",
    "create_topology",
    "list_testbed_namespaces",
    "netem_available",
    "new_run_id",
    "read_counters",
    "run_owner_pid",
    "teardown",
]

NAME_PREFIX = "lhtb-"
#: The node side of each link, inside the node's namespace (GLOO_SOCKET_IFNAME points at it).
NODE_INTERFACE = "eth0"
BRIDGE = "lhtb-br"
#: Node ``k`` gets ``SUBNET_PREFIX + str(k + 1)``; the /24 exists only inside our namespaces.
SUBNET_PREFIX = "10.213.0."
SUBNET_BITS = 24
STATE_DIR = Path("/run/lhtb-testbed")
_NAMESPACE_PATTERN = re.compile(r"^lhtb-(?P<run_id>[0-9a-f]+)-")
_KILL_WAIT_SECONDS = 5.0


class TestbedError(RuntimeError):
    """An ``ip``/``tc`` command failed while building or inspecting the testbed."""

    __test__ = False


@dataclass(frozen=True)
class InterfaceCounters:
    """Byte and packet counters of one interface (``ip -s`` stats64)."""

    tx_bytes: int = 0
    rx_bytes: int = 0
    tx_packets: int = 0
    rx_packets: int = 0

    def __sub__(self, earlier: InterfaceCounters) -> InterfaceCounters:
        return InterfaceCounters(
            tx_bytes=self.tx_bytes - earlier.tx_bytes,
            rx_bytes=self.rx_bytes - earlier.rx_bytes,
            tx_packets=self.tx_packets - earlier.tx_packets,
            rx_packets=self.rx_packets - earlier.rx_packets,
        )

    def to_dict(self) -> dict[str, int]:
        """JSON-ready fields."""
        return asdict(self)


@dataclass
class Topology:
    """Names and addresses of one run's namespaces (created by :func:`create_topology`)."""

    run_id: str
    nodes: int
    switch_namespace: str
    node_namespaces: list[str]
    node_addresses: list[str]
    created: list[str] = field(default_factory=list)  # namespaces that exist now, in creation order


def new_run_id() -> str:
    """A short random hex id; namespace names are ``lhtb-<id>-...``."""
    return secrets.token_hex(3)


def node_address(node: int) -> str:
    """IPv4 address of node ``node`` (0-based) on its ``eth0``."""
    return f"{SUBNET_PREFIX}{node + 1}"


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and completed.returncode != 0:
        problem = (completed.stderr or completed.stdout).strip().replace("\n", " ")
        raise TestbedError(f"'{' '.join(argv)}' failed (exit {completed.returncode}): {problem}")
    return completed


def _process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (tells a live owner from a recycled pid), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22 of stat; fields after ")" start at field 3


def _state_path(run_id: str) -> Path:
    return STATE_DIR / f"{run_id}.json"


def _write_state(run_id: str, namespaces: list[str]) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    state = {
        "run_id": run_id,
        "owner_pid": os.getpid(),
        "owner_start_ticks": _process_start_ticks(os.getpid()),
        "namespaces": namespaces,
        "created_at": time.time(),
    }
    _state_path(run_id).write_text(json.dumps(state))


def _owner_alive(run_id: str) -> int | None:
    """The pid of the live process that owns ``run_id``, or None when the owner is gone or unknown."""
    try:
        state = json.loads(_state_path(run_id).read_text())
    except (OSError, ValueError):
        return None
    pid = state.get("owner_pid")
    if not isinstance(pid, int):
        return None
    ticks = _process_start_ticks(pid)
    return pid if ticks is not None and ticks == state.get("owner_start_ticks") else None


def run_owner_pid(run_id: str) -> int | None:
    """The pid of the live testbed that owns run ``run_id``, or None when it is gone (other resources use this too)."""
    return _owner_alive(run_id)


def _disable_ipv6(namespace: str) -> None:
    # Fresh interfaces would otherwise send router solicitations, MLD reports and DAD probes, which the byte
    # counters would charge to the workload. Best effort: a kernel without IPv6 has nothing to disable.
    keys = ("net.ipv6.conf.all.disable_ipv6", "net.ipv6.conf.default.disable_ipv6")
    script = "; ".join(f"echo 1 > /proc/sys/{key.replace('.', '/')}" for key in keys)
    _run(["ip", "netns", "exec", namespace, "sh", "-c", script + " 2>/dev/null; true"], check=False)


def _add_namespace(topology: Topology, name: str) -> None:
    _run(["ip", "netns", "add", name])
    topology.created.append(name)
    _disable_ipv6(name)
    _run(["ip", "-n", name, "link", "set", "lo", "up"])


def _no_offloads(namespace: str, interface: str) -> None:
    _run(["ip", "-n", namespace, "link", "set", "dev", interface, "gso_max_segs", "1", "gso_max_size", "1500"])


def create_topology(
    nodes: int,
    tbf: TbfParameters | None,
    latency_seconds: float | None = None,
    run_id: str | None = None,
) -> Topology:
    """Create the switch and node namespaces, link them, address them and shape the links.

    On any failure the partial topology is removed before the error propagates.

    Args:
        nodes: Number of node namespaces.
        tbf: Shaping for both directions of every node link, or None for unshaped links.
        latency_seconds: One-way delay added on every node's uplink with netem (None: no delay).
        run_id: Reuse an id (default: a fresh one).

    Returns:
        The created :class:`Topology`.

    Raises:
        TestbedError: An ``ip``/``tc`` command failed (its stderr is in the message).
    """
    run_id = run_id or new_run_id()
    topology = Topology(
        run_id=run_id,
        nodes=nodes,
        switch_namespace=f"{NAME_PREFIX}{run_id}-sw",
        node_namespaces=[f"{NAME_PREFIX}{run_id}-n{node}" for node in range(nodes)],
        node_addresses=[node_address(node) for node in range(nodes)],
    )
    _write_state(run_id, [topology.switch_namespace, *topology.node_namespaces])
    try:
        switch = topology.switch_namespace
        _add_namespace(topology, switch)
        _run(["ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", BRIDGE, "up"])
        for node, (namespace, address) in enumerate(
            zip(topology.node_namespaces, topology.node_addresses, strict=True)
        ):
            peer = f"lhtb-n{node}"
            _add_namespace(topology, namespace)
            # Created inside the node namespace with the peer placed straight into the switch: nothing in root.
            veth = ["link", "add", NODE_INTERFACE, "type", "veth", "peer", "name", peer, "netns", switch]
            _run(["ip", "-n", namespace, *veth])
            _no_offloads(namespace, NODE_INTERFACE)
            _no_offloads(switch, peer)
            _run(["ip", "-n", switch, "link", "set", peer, "master", BRIDGE])
            _run(["ip", "-n", switch, "link", "set", peer, "up"])
            _run(["ip", "-n", namespace, "addr", "add", f"{address}/{SUBNET_BITS}", "dev", NODE_INTERFACE])
            _run(["ip", "-n", namespace, "link", "set", NODE_INTERFACE, "up"])
            _shape(namespace, NODE_INTERFACE, tbf, latency_seconds)
            _shape(switch, peer, tbf, None)
    except BaseException:
        teardown(topology)
        raise
    return topology


def _shape(namespace: str, interface: str, tbf: TbfParameters | None, latency_seconds: float | None) -> None:
    """Root qdiscs of one link direction: tbf, or netem delay with the tbf as its only child."""
    base = ["tc", "-n", namespace, "qdisc", "add", "dev", interface]
    if latency_seconds is None:
        if tbf is not None:
            _run([*base, "root", "handle", "1:", "tbf", *tbf.tc_arguments()])
        return
    # netem's default 1000-packet queue would drop at high rate x delay; hold two delay-windows of full frames.
    rate = tbf.rate_bits_per_second if tbf is not None else 10e9
    packets = max(1000, int(2 * rate / 8 * latency_seconds / 1514) + 1)
    delay = f"{round(latency_seconds * 1e6)}us"
    _run([*base, "root", "handle", "1:", "netem", "delay", delay, "limit", str(packets)])
    if tbf is not None:
        _run([*base, "parent", "1:1", "handle", "10:", "tbf", *tbf.tc_arguments()])


def read_counters(namespace: str, interface: str = NODE_INTERFACE) -> InterfaceCounters:
    """Byte and packet counters of ``interface`` in ``namespace`` (from ``ip -j -s link show``)."""
    completed = _run(["ip", "-j", "-s", "-n", namespace, "link", "show", "dev", interface])
    stats = json.loads(completed.stdout)[0]["stats64"]
    return InterfaceCounters(
        tx_bytes=int(stats["tx"]["bytes"]),
        rx_bytes=int(stats["rx"]["bytes"]),
        tx_packets=int(stats["tx"]["packets"]),
        rx_packets=int(stats["rx"]["packets"]),
    )


def namespace_pids(namespace: str) -> list[int]:
    """Pids of the processes whose network namespace is ``namespace``."""
    completed = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(token) for token in completed.stdout.split() if token.isdigit()]


def _kill_namespace_processes(namespace: str) -> list[int]:
    """SIGKILL every process inside ``namespace`` (ours by construction) and wait until they are gone."""
    pids = namespace_pids(namespace)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _KILL_WAIT_SECONDS
    while pids and namespace_pids(namespace) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def teardown(topology: Topology) -> list[str]:
    """Kill stragglers inside the run's namespaces, delete the namespaces (their veths go with them), drop the state.

    Safe to call twice and on a partial topology. Returns the namespaces deleted.
    """
    removed = []
    for namespace in [*reversed(topology.created)]:
        _kill_namespace_processes(namespace)
        if _run(["ip", "netns", "del", namespace], check=False).returncode == 0:
            removed.append(namespace)
    topology.created.clear()
    _state_path(topology.run_id).unlink(missing_ok=True)
    return removed


def list_testbed_namespaces() -> list[str]:
    """Every namespace whose name starts with ``lhtb-`` (any run, live or dead)."""
    completed = _run(["ip", "-j", "netns", "list"], check=False)
    entries: list[Any] = json.loads(completed.stdout) if completed.stdout.strip() else []
    return sorted(entry["name"] for entry in entries if str(entry.get("name", "")).startswith(NAME_PREFIX))


def cleanup_leftovers(log: Any = None) -> list[str]:
    """Remove ``lhtb-*`` namespaces left by killed runs (and the processes still inside them).

    Namespaces of a run whose owning testbed process is still alive are kept. Nothing without the ``lhtb-`` prefix
    is ever touched.

    Args:
        log: Optional callable taking one line per action (e.g. ``print``).

    Returns:
        The names of the namespaces removed.
    """
    say = log or (lambda line: None)
    removed: list[str] = []
    for namespace in list_testbed_namespaces():
        match = _NAMESPACE_PATTERN.match(namespace)
        owner = _owner_alive(match["run_id"]) if match else None
        if owner is not None:
            say(f"kept {namespace}: its testbed (pid {owner}) is still running")
            continue
        killed = _kill_namespace_processes(namespace)
        if killed:
            say(f"killed {len(killed)} leftover process(es) in {namespace}: {' '.join(map(str, killed))}")
        if _run(["ip", "netns", "del", namespace], check=False).returncode == 0:
            removed.append(namespace)
            say(f"removed {namespace}")
    if STATE_DIR.is_dir():
        for state_file in STATE_DIR.glob("*.json"):
            if _owner_alive(state_file.stem) is None:
                state_file.unlink(missing_ok=True)
    return removed


def netem_available() -> bool:
    """Whether ``tc`` can attach a netem qdisc, probed in a throw-away ``lhtb-<id>-probe`` namespace."""
    topology = Topology(new_run_id(), 0, "", [], [])
    probe = f"{NAME_PREFIX}{topology.run_id}-probe"
    _write_state(topology.run_id, [probe])
    try:
        _run(["ip", "netns", "add", probe])
        topology.created.append(probe)
        completed = _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
        return completed.returncode == 0
    finally:
        teardown(topology)
