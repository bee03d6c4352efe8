"""``--selftest``: does a shaped link deliver its set rate? One bulk TCP flow per rate between two nodes.

For each rate (default 50mbit and 200mbit) a fresh 2-node testbed runs
``python -m lightning_hetero.testbed.throughput`` as receiver in node 1 and sender in node 0 for ``seconds``. The
receiver measures, after a warm-up, the wire rate (its ``eth0`` rx byte counter: Ethernet frames as tbf shapes them)
and the goodput (payload read). A rate passes when the wire rate is within ``tolerance`` of the set rate; goodput is
reported too and sits near 1448/1514 = 95.6% of the rate (TCP/IP/Ethernet headers, 1500-byte MTU).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, TextIO

from lightning_hetero.testbed.bed import Testbed
from lightning_hetero.testbed.checks import parse_rate

__all__ = ["DEFAULT_RATES", "run_selftest"]

DEFAULT_RATES = ("50mbit", "200mbit")
_PORT = 5201
_MODULE = "lightning_hetero.testbed.throughput"


def _measure(bed: Testbed, seconds: float) -> dict[str, Any]:
    """One transfer node 0 -> node 1; the receiver's JSON line."""
    receiver = bed.popen(
        1,
        [sys.executable, "-m", _MODULE, "receive", "--port", str(_PORT), "--timeout", str(seconds + 10)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sender = bed.popen(
        0,
        [sys.executable, "-m", _MODULE, "send", "--host", bed.node_address(1), "--port", str(_PORT)]
        + ["--seconds", str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        sender_out, sender_err = sender.communicate(timeout=seconds + 15)
        receiver_out, receiver_err = receiver.communicate(timeout=15)
    finally:
        for process in (sender, receiver):
            if process.poll() is None:
                process.kill()
                process.wait()
    if sender.returncode != 0 or receiver.returncode != 0:
        raise RuntimeError(
            f"throughput transfer failed: sender {sender_err.strip()!r}, receiver {receiver_err.strip()!r}"
        )
    return json.loads(receiver_out.strip().splitlines()[-1])


def run_selftest(
    rates: Sequence[str] = DEFAULT_RATES,
    *,
    seconds: float = 3.0,
    tolerance: float = 0.10,
    output: TextIO | None = None,
) -> dict[str, Any]:
    """Measure one TCP flow at each rate; print a JSON summary and a PASS/FAIL line per rate to ``output``.

    Args:
        rates: ``tc``-style rates to check.
        seconds: Length of each transfer (the first 0.5 s are not measured).
        tolerance: Allowed relative deviation of the wire rate from the set rate.
        output: Where the summary goes (default: stdout).

    Returns:
        ``{"passed": bool, "tolerance": float, "seconds": float, "rates": [{"bandwidth", "set_bits_per_second",
        "wire_bits_per_second", "goodput_bits_per_second", "wire_ratio", "goodput_ratio", "passed"}, ...]}``.
    """
    stream = output or sys.stdout
    results = []
    for rate in rates:
        set_rate = parse_rate(rate)
        if set_rate is None:
            raise ValueError("the selftest needs shaped rates, not 'none'")
        with tempfile.TemporaryDirectory(prefix="lhtb-selftest-") as run_dir:
            with Testbed(nodes=2, ranks_per_node=1, bandwidth=rate, run_dir=run_dir) as bed:
                measured = _measure(bed, seconds)
        wire_ratio = measured["wire_bits_per_second"] / set_rate
        results.append(
            {
                "bandwidth": rate,
                "set_bits_per_second": set_rate,
                "wire_bits_per_second": measured["wire_bits_per_second"],
                "goodput_bits_per_second": measured["goodput_bits_per_second"],
                "wire_ratio": wire_ratio,
                "goodput_ratio": measured["goodput_bits_per_second"] / set_rate,
                "measured_seconds": measured["seconds"],
                "passed": abs(wire_ratio - 1.0) <= tolerance,
            }
        )
    summary = {"passed": all(r["passed"] for r in results), "tolerance": tolerance, "seconds": seconds}
    summary["rates"] = results
    stream.write(json.dumps(summary, indent=1) + "\n")
    for r in results:
        stream.write(
            f"{'PASS' if r['passed'] else 'FAIL'} {r['bandwidth']}: wire {r['wire_bits_per_second'] / 1e6:.2f} Mbit/s"
            f" ({r['wire_ratio']:.1%} of set), goodput {r['goodput_bits_per_second'] / 1e6:.2f} Mbit/s"
            f" ({r['goodput_ratio']:.1%})\n"
        )
    stream.flush()
    return summary
