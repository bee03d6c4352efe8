"""Input validation and environment checks: pure functions, nothing is created here.

Every refusal is a :class:`TestbedConfigError` whose message is ONE line saying what is wrong and what to do; the CLI
prints it and exits with code 2 before any namespace exists.
"""

from __future__ import annotations

import math
import os
import re
import shutil

from lightning_hetero.comm.units import parse_bandwidth

__all__ = [
    "MAX_NODES",
    "MIN_RATE_BITS_PER_SECOND",
    "UNTHROTTLED_WORDS",
    "TestbedConfigError",
    "check_environment",
    "parse_latency",
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


def check_environment(*, need_netem: bool = False) -> None:
    """Refuse to start without root, without ``ip``/``tc``, or (when asked) without netem.

    Args:
        need_netem: Also check that the kernel has the netem qdisc (only needed for ``--latency``). This probe
            creates and deletes one throw-away ``lhtb-<id>-probe`` namespace.

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
