"""``--selftest-cgroups``: do the node cgroups really give nodes unequal compute and memory?

One 2-node testbed with CPU quotas (default 1.0 and 0.5 cores) and a memory limit on node 1 (default 64Mi):

1. **CPU.** Both nodes run a pure-Python busy loop (``burn.py cpu``) for ``seconds`` at the same time, pinned to the
   same CPU (default quotas 0.5 and 0.25 fit on it together). Each counts its iterations; the ratio of the two work
   rates must match the ratio of the quotas within ``tolerance``.
2. **Memory.** Both nodes touch ``allocate`` bytes (default 256Mi). Node 0 (no limit) finishes; node 1 must be
   killed by the kernel (SIGKILL, exit status 137) with the OOM kill counted by its cgroup.
3. **Nothing left behind.** After the testbed closes, no group or namespace of the run remains.

The loop never sleeps and the allocator never stops on its own: slowness and death come only from the kernel.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from lightning_hetero.testbed.bed import Testbed
from lightning_hetero.testbed.cgroups import list_testbed_cgroups
from lightning_hetero.testbed.checks import parse_memory_size
from lightning_hetero.testbed.netns import list_testbed_namespaces

__all__ = ["run_cgroup_selftest"]

_BURN = str(Path(__file__).with_name("burn.py"))
_SIGKILL_STATUS = 128 + signal.SIGKILL


def _result_lines(output: str) -> dict[str, dict[str, Any]]:
    """The last JSON line each process printed, by process name (``[n0r0] {...}`` -> ``{"n0r0": {...}}``)."""
    results: dict[str, dict[str, Any]] = {}
    for line in output.splitlines():
        prefix, _, rest = line.partition("] ")
        if prefix.startswith("[") and rest.startswith("{"):
            try:
                results[prefix[1:]] = json.loads(rest)
            except ValueError:
                continue
    return results


def _cpu_part(
    bed: Testbed, quotas: Sequence[float], seconds: float, tolerance: float, pin: int | None
) -> dict[str, Any]:
    output = io.StringIO()
    command = [sys.executable, _BURN, "cpu", "--seconds", str(seconds)] + ([] if pin is None else ["--pin", str(pin)])
    result = bed.run(command, output=output, timeout=seconds + 60)
    lines = _result_lines(output.getvalue())
    rates = [lines.get(f"n{node}r{node}", {}).get("rate") for node in range(2)]
    cgroups = [node["cgroup"] for node in result.report["nodes"]]
    if result.exit_code != 0 or None in rates:
        return {"passed": False, "error": f"burn exited with {result.exit_code}: {output.getvalue()[-500:]}"}
    expected, measured = quotas[0] / quotas[1], rates[0] / rates[1]
    return {
        "quotas": list(quotas),
        "seconds": seconds,
        "rates": rates,
        "cpu_seconds": [cgroup["cpu_seconds"] for cgroup in cgroups],
        "throttled_periods": [cgroup["cpu_throttled_periods"] for cgroup in cgroups],
        "cpu_seconds_ratio": cgroups[0]["cpu_seconds"] / cgroups[1]["cpu_seconds"]
        if cgroups[1]["cpu_seconds"]
        else None,
        "expected_ratio": expected,
        "measured_ratio": measured,
        "passed": abs(measured / expected - 1.0) <= tolerance,
    }


def _memory_part(bed: Testbed, limit_bytes: int, allocate_bytes: int) -> dict[str, Any]:
    output = io.StringIO()
    result = bed.run([sys.executable, _BURN, "memory", "--bytes", str(allocate_bytes)], output=output, timeout=60)
    statuses = [process["exit_status"] for process in result.report["processes"]]
    cgroups = [node["cgroup"] for node in result.report["nodes"]]
    oom_kills = [cgroup["oom_kills"] for cgroup in cgroups]
    lines = _result_lines(output.getvalue())
    reached = lines.get("n1r1", {}).get("progress_bytes")
    return {
        "limit_bytes": limit_bytes,
        "allocate_bytes": allocate_bytes,
        "exit_statuses": statuses,
        "oom_kills": oom_kills,
        "memory_peak_bytes": [cgroup["memory_peak_bytes"] for cgroup in cgroups],
        "limited_node_reached_bytes": reached,
        "passed": statuses == [0, _SIGKILL_STATUS] and (oom_kills[1] or 0) >= 1 and not oom_kills[0],
    }


def _pinned_cpu(pin: int | None) -> int | None:
    if pin is None or pin >= 0:
        return pin
    return sorted(os.sched_getaffinity(0))[pin]


def run_cgroup_selftest(
    quotas: Sequence[float] = (0.5, 0.25),
    *,
    seconds: float = 3.0,
    memory_limit: str = "64Mi",
    allocate: str = "256Mi",
    tolerance: float = 0.10,
    pin: int | None = -1,
    output: TextIO | None = None,
) -> dict[str, Any]:
    """Check CPU quotas, the memory limit and removal; print a JSON summary and PASS/FAIL lines to ``output``.

    Args:
        quotas: CPU quotas of node 0 and node 1, in cores. Together they fit on one CPU, see ``pin``.
        seconds: Length of the busy loops.
        memory_limit: Node 1's memory limit (node 0 has none).
        allocate: What each node tries to allocate; must exceed ``memory_limit``.
        tolerance: Allowed relative deviation of the work-rate ratio from the quota ratio.
        pin: Run both busy loops on this CPU (negative: index from the end of the usable CPUs; None: anywhere).
            On a VM whose virtual CPUs slow each other down (ours: 22% when both are busy), loops on different
            CPUs with different duty cycles run at different speeds per CPU-second; on one CPU both see the same.
        output: Where the summary goes (default: stdout).

    Returns:
        ``{"passed", "cgroup_version", "cpu": {...}, "memory": {...}, "leftovers": {...}}``.
    """
    stream = output or sys.stdout
    limit_bytes, allocate_bytes = parse_memory_size(memory_limit), parse_memory_size(allocate)
    if allocate_bytes <= limit_bytes:
        raise ValueError(f"allocate ({allocate}) must exceed memory_limit ({memory_limit}) to trigger the OOM killer")
    with tempfile.TemporaryDirectory(prefix="lhtb-selftest-") as run_dir:
        bed = Testbed(nodes=2, node_cpu=list(quotas), node_memory=[None, memory_limit], run_dir=run_dir)
        with bed:
            run_id, version = bed.run_id, bed.cgroups.layout.version if bed.cgroups else None
            cpu = _cpu_part(bed, quotas, seconds, tolerance, _pinned_cpu(pin))
            memory = _memory_part(bed, limit_bytes, allocate_bytes)
    groups = [str(path) for path in list_testbed_cgroups() if path.name.startswith(f"lhtb-{run_id}-")]
    namespaces = [name for name in list_testbed_namespaces() if name.startswith(f"lhtb-{run_id}-")]
    leftovers = {"cgroups": groups, "namespaces": namespaces, "passed": not groups and not namespaces}
    summary = {"passed": cpu["passed"] and memory["passed"] and leftovers["passed"], "run_id": run_id}
    summary |= {"cgroup_version": version, "tolerance": tolerance, "cpu": cpu, "memory": memory}
    summary["leftovers"] = leftovers
    stream.write(json.dumps(summary, indent=1) + "\n")
    verdict = {True: "PASS", False: "FAIL"}
    if "measured_ratio" in cpu:
        stream.write(
            f"{verdict[cpu['passed']]} cpu: work-rate ratio {cpu['measured_ratio']:.3f} for quotas"
            f" {quotas[0]:g}/{quotas[1]:g} = {cpu['expected_ratio']:.3f} (tolerance {tolerance:.0%})\n"
        )
    else:
        stream.write(f"FAIL cpu: {cpu.get('error')}\n")
    stream.write(
        f"{verdict[memory['passed']]} memory: node 1 (limit {memory_limit}) exit status {memory['exit_statuses'][1]},"
        f" OOM kills {memory['oom_kills'][1]}; node 0 (no limit) exit status {memory['exit_statuses'][0]}\n"
    )
    stream.write(f"{verdict[leftovers['passed']]} leftovers: {groups + namespaces or 'none'}\n")
    stream.flush()
    return summary
