"""Bandwidth testbed: real traffic between simulated nodes on one machine, over rate-limited links.

Each node is a Linux network namespace; ranks of one node talk over its loopback (unshaped), traffic between nodes
crosses veth links into a bridge, shaped with ``tc`` (tbf, both directions; netem delay when the kernel has it).
The command runs in every namespace with a torchrun-style environment; afterwards each node's wire bytes (veth
counters) are reported next to the byte ledger its ranks dumped. See ``docs/testbed.md``.

    from lightning_hetero.testbed import Testbed

    with Testbed(nodes=2, ranks_per_node=1, bandwidth="100mbit") as bed:
        result = bed.run(["python", "-m", "lightning_hetero.testbed.probe", "--steps", "3"], timeout=120)
    result.exit_code, result.report["nodes"][1]["wire"]["rx_bytes"]

Needs root and iproute2; :func:`check_environment` refuses otherwise with one line naming the fix.
"""

from lightning_hetero.testbed.bed import RunResult, Testbed, TestbedInterrupted
from lightning_hetero.testbed.cgroups import (
    CgroupUsage,
    NodeLimits,
    cleanup_leftover_cgroups,
    list_testbed_cgroups,
)
from lightning_hetero.testbed.checks import (
    TestbedConfigError,
    check_environment,
    parse_latency,
    parse_memory_size,
    parse_node_cpu,
    parse_node_memory,
    parse_rate,
)
from lightning_hetero.testbed.launch import LAUNCH_MODES, node_environment, rank_environment, worst_exit_code
from lightning_hetero.testbed.netns import (
    InterfaceCounters,
    TestbedError,
    cleanup_leftovers,
    list_testbed_namespaces,
    netem_available,
)
from lightning_hetero.testbed.report import REPORT_SCHEMA, build_report
from lightning_hetero.testbed.shaping import TbfParameters, tbf_parameters

__all__ = [
    "LAUNCH_MODES",
    "REPORT_SCHEMA",
    "CgroupUsage",
    "InterfaceCounters",
    "NodeLimits",
    "RunResult",
    "TbfParameters",
    "Testbed",
    "TestbedConfigError",
    "TestbedError",
    "TestbedInterrupted",
    "build_report",
    "check_environment",
    "cleanup_leftover_cgroups",
    "cleanup_leftovers",
    "list_testbed_cgroups",
    "list_testbed_namespaces",
    "netem_available",
    "node_environment",
    "parse_latency",
    "parse_memory_size",
    "parse_node_cpu",
    "parse_node_memory",
    "parse_rate",
    "rank_environment",
    "tbf_parameters",
    "worst_exit_code",
]
