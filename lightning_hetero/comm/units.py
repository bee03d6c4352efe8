"""Bandwidth and byte units with Linux ``tc`` semantics.

``tc`` (and therefore the bandwidth testbed, which shapes links with ``tc``) spells rates in two families:

- ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` are **bits** per second, SI prefixes (``1mbit`` = 1e6 bit/s);
- ``bps``, ``kbps``, ``mbps``, ``gbps``, ``tbps`` are **bytes** per second (``1mbps`` = 8e6 bit/s). This is the
  classic ``tc`` trap: ``mbps`` is *not* megabits.

The IEC forms ``kibit``, ``mibit``, ``gibit``, ``tibit`` and ``kibps`` ... ``tibps`` (powers of 1024) are accepted
too, as ``tc`` does. Units are case-insensitive, decimals and exponents are allowed (``"1.5gbit"``, ``"2e9bit"``) and a
bare number is bits per second. Every function returns plain floats/ints: this module imports nothing heavy.
"""

from __future__ import annotations

import math
import re

__all__ = ["BANDWIDTH_UNITS", "format_bytes", "parse_bandwidth", "transfer_seconds"]

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_IEC = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}

#: Accepted unit suffix -> bits per second for one unit. ``bit`` forms count bits, ``bps`` forms count bytes (x8).
BANDWIDTH_UNITS: dict[str, float] = {
    "": 1.0,  # a bare number is bits/s
    **{f"{prefix}bit": scale for prefix, scale in {**_SI, **_IEC}.items()},
    **{f"{prefix}bps": 8.0 * scale for prefix, scale in {**_SI, **_IEC}.items()},
}

_RATE_PATTERN = re.compile(r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>[a-z]*)\s*$")
_UNITS_HELP = "bit, kbit, mbit, gbit, tbit (bits/s) or bps, kbps, mbps, gbps, tbps (BYTES/s, as in tc)"


def _invalid(rate: object, why: str) -> ValueError:
    return ValueError(
        f"Invalid bandwidth {rate!r}: {why}. Use a positive number followed by one of {_UNITS_HELP};"
        " IEC forms like 'mibit' are also accepted, and a bare number means bits/s."
        " Example: '100mbit' (= 1e8 bit/s) or '1.5gbit'."
    )


def parse_bandwidth(rate: str | float | int) -> float:
    """Parse a ``tc``-style rate into bits per second.

    Args:
        rate: A string such as ``"100mbit"``, ``"1.5GBit"`` or ``"10mbps"`` (bytes/s, = 8e7 bit/s), or a positive
            number of bits per second.

    Returns:
        The rate in bits per second, a positive finite float.

    Raises:
        ValueError: The value is empty, not a number, zero, negative, infinite, or has an unknown unit. The message
            names the bad value and lists the accepted units with an example.
    """
    if isinstance(rate, bool):  # bool is an int subclass; True bits/s is certainly a mistake
        raise _invalid(rate, "a boolean is not a rate")
    if isinstance(rate, (int, float)):
        bits_per_second = float(rate)
    elif isinstance(rate, str):
        match = _RATE_PATTERN.match(rate.lower())
        if match is None:
            raise _invalid(rate, "expected '<positive number><unit>'")
        unit = match["unit"]
        if unit not in BANDWIDTH_UNITS:
            raise _invalid(rate, f"unknown unit {unit!r}")
        bits_per_second = float(match["number"]) * BANDWIDTH_UNITS[unit]
    else:
        raise _invalid(rate, f"expected a string or a number, got {type(rate).__name__}")
    if not math.isfinite(bits_per_second) or bits_per_second <= 0:
        raise _invalid(rate, "the rate must be positive and finite")
    return bits_per_second


def format_bytes(num_bytes: int | float) -> str:
    """Format a byte count for humans with binary prefixes.

    Args:
        num_bytes: A byte count; negative values keep their sign.

    Returns:
        ``"512 B"`` below 1 KiB, otherwise two decimals and the largest fitting unit, e.g. ``"1.50 MiB"``.
    """
    sign = "-" if num_bytes < 0 else ""
    magnitude = float(abs(num_bytes))
    if magnitude < 1024:
        return f"{sign}{magnitude:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        magnitude /= 1024.0
        if magnitude < 1024 or unit == "PiB":
            return f"{sign}{magnitude:.2f} {unit}"
    raise AssertionError("unreachable")


def transfer_seconds(num_bytes: int | float, rate: str | float | int) -> float:
    """Seconds needed to move ``num_bytes`` over a link of ``rate`` (no latency, no protocol overhead).

    Args:
        num_bytes: Payload in bytes (non-negative).
        rate: Anything :func:`parse_bandwidth` accepts.

    Returns:
        ``num_bytes * 8 / parse_bandwidth(rate)``.

    Raises:
        ValueError: ``num_bytes`` is negative, or ``rate`` is invalid.
    """
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}.")
    return num_bytes * 8.0 / parse_bandwidth(rate)
