"""Input validation and environment checks: pure functions, nothing is created here.

Every refusal is a :class:`TestbedConfigError` whose message is ONE line saying what is wrong and what to do; the CLI
prints it and exits with code 2 before any namespace exists.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Collection, Sequence

from lightning_hetero.comm.units import parse_bandwidth

__all__ = [
    "MAX_NODES",
    "MIN_RATE_BITS_PER_SECOND",
    "UNTHROTTLED_WORDS",
    "TestbedConfigError",
    "check_environment",
    "parse_latency",
    "parse_node_cpu",
    "parse_node_memory",
    "parse_rate",
    "validate_layout",
]

#: Node addresses are ``10.213.0.<k+1>/24``: 254 usable hosts.
MAX_NODES = 254
#: Below this tbf's token arithmetic gets coarse and a single full-size frame takes > 1.5 s; nobody needs it.
MIN_RATE_BITS_PER_SECOND = 8_000.0
#: Spellings of "do not shape the link".
UNTHROTTLED_WORDS = frozenset({"none", "unthrottled", "unlimited", "off"})

_LATENCY_PATTERN = re.compile(r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>[a-z]*)\s*$")
_LATENCY_UNITS = {
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "ms": 1e-3,
    "msec": 1e-3,
    "msecs": 1e-3,
    "us": 1e-6,
    "usec": 1e-6,
    "usecs": 1e-6,
}


_MEMORY_PATTERN = re.compile(r"^\s*(?P<number>-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>[a-z]*)\s*$")
#: Decimal K/M/G/T (1000^n) and binary Ki/Mi/Gi/Ti (1024^n), case-insensitive, with an optional trailing "b".
_MEMORY_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_MEMORY_UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
#: Below this not even a shell starts; nobody means it.
MIN_NODE_MEMORY_BYTES = 4 * 2**20
#: Spellings of "no limit" in a per-node list (an empty entry means the same).
UNLIMITED_ENTRIES = frozenset({"", "none", "unlimited", "max"})

PerNode = str | float | int | None


class TestbedConfigError(ValueError):
    """Bad input or an unusable machine; the message is one line: the problem, then the fix."""

    __test__ = False  # not a pytest test class, despite the name


def parse_rate(bandwidth: str | float | int | None) -> float | None:
    """Bits per second of a ``tc``-style rate, or ``None`` for an unthrottled link.

    Args:
        bandwidth: ``"100mbit"``, ``"10mbps"`` (BYTES/s, as in tc), a number of bits/s, or ``None``/``"none"``.

    Returns:
        The rate in bits/s, or ``None`` when the link is not shaped.

    Raises:
        TestbedConfigError: Unknown unit, not a number, or below 8kbit.
    """
    if bandwidth is None or (isinstance(bandwidth, str) and bandwidth.strip().lower() in UNTHROTTLED_WORDS):
        return None
    try:
        bits_per_second = parse_bandwidth(bandwidth)
    except ValueError as error:
        raise TestbedConfigError(f"--bandwidth: {error} Use 'none' for an unthrottled link.") from None
    if bits_per_second < MIN_RATE_BITS_PER_SECOND:
        raise TestbedConfigError(
            f"--bandwidth {bandwidth!r} is {bits_per_second:g} bit/s, below the testbed's minimum of 8kbit;"
            " use a rate of at least 8kbit (e.g. '1mbit')."
        )
    return bits_per_second


def parse_latency(latency: str | float | None) -> float | None:
    """Seconds of a ``tc``-style duration (``"20ms"``, ``"0.5s"``, ``"300us"``), or ``None``.

    A bare number is refused: tc reads it as microseconds, which nobody expects.

    Raises:
        TestbedConfigError: No unit, unknown unit, or not positive.
    """
    if latency is None:
        return None
    if isinstance(latency, (int, float)) and not isinstance(latency, bool):
        seconds = float(latency)
    else:
        match = _LATENCY_PATTERN.match(str(latency).lower())
        if match is None or match["unit"] not in _LATENCY_UNITS:
            raise TestbedConfigError(
                f"--latency {latency!r} is not a duration; give a number with a unit (s, ms or us), e.g. '20ms'."
            )
        seconds = float(match["number"]) * _LATENCY_UNITS[match["unit"]]
    if not math.isfinite(seconds) or seconds <= 0:
        raise TestbedConfigError(f"--latency {latency!r} must be positive; omit --latency for no added delay.")
    return seconds


def _per_node_entries(value: PerNode | Sequence[PerNode], nodes: int, flag: str, example: str) -> list[PerNode]:
    """Split ``"1.0,0.5"`` (or take a list) into one entry per node; one entry applies to every node."""
    if isinstance(value, str):
        entries: list[PerNode] = [entry.strip() for entry in value.split(",")]
    elif isinstance(value, Sequence):
        entries = list(value)
    else:
        entries = [value]
    if len(entries) == 1:
        entries = entries * nodes
    if len(entries) != nodes:
        raise TestbedConfigError(
            f"{flag} has {len(entries)} values for {nodes} nodes; give one per node or one for all (e.g. {example})."
        )
    return entries


def _unlimited(entry: PerNode) -> bool:
    return entry is None or (isinstance(entry, str) and entry.strip().lower() in UNLIMITED_ENTRIES)


def parse_node_cpu(node_cpu: PerNode | Sequence[PerNode], nodes: int) -> list[float | None] | None:
    """Each node's CPU quota in cores (``"1.0,0.5"``: node 0 one core, node 1 half a core), or None for no limits.

    Args:
        node_cpu: A comma-separated string, a list with one entry per node, or one value for every node. An entry
            ``none`` (or empty) leaves that node unlimited.
        nodes: Number of nodes.

    Returns:
        One quota (or None) per node; None when no node is limited.

    Raises:
        TestbedConfigError: Wrong number of entries, not a number, or below 0.01 cores.
    """
    from lightning_hetero.testbed.cgroups import MIN_CPU_QUOTA  # lazy: keeps this module free of cgroup code

    if node_cpu is None:
        return None
    quotas: list[float | None] = []
    for entry in _per_node_entries(node_cpu, nodes, "--node-cpu", "--node-cpu 1.0,0.5"):
        if _unlimited(entry):
            quotas.append(None)
            continue
        try:
            quota = float(entry)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise TestbedConfigError(
                f"--node-cpu entry {entry!r} is not a number of cores; use e.g. 1.0 or 0.5, or 'none' for no limit."
            ) from None
        if not math.isfinite(quota) or quota < MIN_CPU_QUOTA:
            raise TestbedConfigError(
                f"--node-cpu entry {entry!r} must be at least {MIN_CPU_QUOTA} cores (the kernel's smallest quota);"
                " use e.g. 0.5, or 'none' for no limit."
            )
        quotas.append(quota)
    return quotas if any(quota is not None for quota in quotas) else None


def parse_memory_size(entry: str | float | int) -> int:
    """Bytes of ``"6G"`` (6e9), ``"1.5Gi"`` (1.5 * 2**30), ``"512Mi"``, ``"64MiB"`` or a bare number of bytes.

    Raises:
        TestbedConfigError: Unknown unit, not a number, or below 4 MiB.
    """
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        size = float(entry)
    else:
        text = str(entry).strip().lower()
        text = text[:-1] if text.endswith("b") else text
        match = _MEMORY_PATTERN.match(text)
        if match is None or match["unit"] not in _MEMORY_UNITS:
            raise TestbedConfigError(
                f"--node-memory entry {entry!r} is not a size; use bytes or a unit K/M/G/T (powers of 1000) or"
                " Ki/Mi/Gi/Ti (powers of 1024), e.g. 6G or 1.5Gi, or 'none' for no limit."
            )
        size = float(match["number"]) * _MEMORY_UNITS[match["unit"]]
    if not math.isfinite(size) or size < MIN_NODE_MEMORY_BYTES:
        raise TestbedConfigError(
            f"--node-memory entry {entry!r} is below the minimum of 4Mi; use e.g. 512Mi, or 'none' for no limit."
        )
    return int(size)


def parse_node_memory(node_memory: PerNode | Sequence[PerNode], nodes: int) -> list[int | None] | None:
    """Each node's memory limit in bytes (``"6G,1.5G"``), or None for no limits; see :func:`parse_memory_size`.

    Raises:
        TestbedConfigError: Wrong number of entries, unknown unit, or below 4 MiB.
    """
    if node_memory is None:
        return None
    limits = [
        None if _unlimited(entry) else parse_memory_size(entry)  # type: ignore[arg-type]
        for entry in _per_node_entries(node_memory, nodes, "--node-memory", "--node-memory 6G,1.5G")
    ]
    return limits if any(limit is not None for limit in limits) else None


def validate_layout(nodes: int, ranks_per_node: int, master_port: int = 29500) -> None:
    """Refuse impossible node/rank counts and ports.

    Raises:
        TestbedConfigError: ``nodes`` outside 1..254, ``ranks_per_node`` < 1, or a port outside 1..65535.
    """
    if not 1 <= nodes <= MAX_NODES:
        raise TestbedConfigError(f"--nodes {nodes} is out of range; use 1 to {MAX_NODES} nodes (e.g. --nodes 2).")
    if ranks_per_node < 1:
        raise TestbedConfigError(f"--ranks-per-node {ranks_per_node} is invalid; use 1 or more (e.g. 1).")
    if not 1 <= master_port <= 65535:
        raise TestbedConfigError(f"--master-port {master_port} is not a TCP port; use 1 to 65535 (e.g. 29500).")


def check_environment(*, need_netem: bool = False, cgroup_controllers: Collection[str] = ()) -> None:
    """Refuse to start without root, without ``ip``/``tc``, or (when asked) without netem or cgroup controllers.

    Args:
        need_netem: Also check that the kernel has the netem qdisc (only needed for ``--latency``). This probe
            creates and deletes one throw-away ``lhtb-<id>-probe`` namespace.
        cgroup_controllers: Controllers the run needs (``"cpu"`` for ``--node-cpu``, ``"memory"`` for
            ``--node-memory``); only mount tables are read.

    Raises:
        TestbedConfigError: The first missing requirement, with what to do about it.
    """
    if os.geteuid() != 0:
        raise TestbedConfigError(
            "the testbed needs root to create network namespaces and shape links;"
            " rerun as root (e.g. sudo python -m lightning_hetero.testbed ...)."
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedConfigError(
                f"'{tool}' was not found on PATH; install iproute2 (e.g. apt-get install iproute2) and rerun."
            )
    if need_netem:
        from lightning_hetero.testbed.netns import netem_available  # lazy: this module stays free of subprocesses

        if not netem_available():
            raise TestbedConfigError("netem is not available in this kernel; rerun without --latency.")
    if cgroup_controllers:
        from lightning_hetero.testbed.cgroups import CgroupUnavailable, select_layout

        try:
            select_layout(cgroup_controllers)
        except CgroupUnavailable as error:
            flags = " and ".join(f"--node-{name}" for name in ("cpu", "memory") if name in cgroup_controllers)
            raise TestbedConfigError(
                f"{error}; mount them (e.g. mount -t cgroup -o {','.join(sorted(cgroup_controllers))} cgroup"
                f" /sys/fs/cgroup/...) or rerun without {flags}."
            ) from None
