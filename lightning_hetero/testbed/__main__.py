"""``python -m lightning_hetero.testbed``: run a command on N simulated nodes joined by shaped links.

    python -m lightning_hetero.testbed --nodes 2 --ranks-per-node 1 --bandwidth 100mbit -- python train.py
    python -m lightning_hetero.testbed --nodes 2 --node-cpu 1.0,0.5 --node-memory 6G,1.5G -- python train.py
    python -m lightning_hetero.testbed --selftest
    python -m lightning_hetero.testbed --selftest-cgroups
    python -m lightning_hetero.testbed --cleanup

Exit codes: the command's worst exit code; 124 on --timeout; 128+N on signal N (130 Ctrl-C, 143 SIGTERM); 2 for
bad input or an unusable machine (one line on stderr, nothing created); 1 when the testbed itself fails.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from lightning_hetero.testbed.bed import Testbed, TestbedInterrupted
from lightning_hetero.testbed.cgroups import cleanup_leftover_cgroups
from lightning_hetero.testbed.checks import TestbedConfigError, check_environment
from lightning_hetero.testbed.launch import LAUNCH_MODES
from lightning_hetero.testbed.netns import TestbedError, cleanup_leftovers

PROG = "python -m lightning_hetero.testbed"
USAGE_EXIT_CODE = 2


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (no usage block) with exit code 2."""

    def error(self, message: str) -> NoReturn:
        _refuse(f"{message}; see '{PROG} --help'.")


def _refuse(message: str) -> NoReturn:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.exit(USAGE_EXIT_CODE)


def _say(line: str) -> None:
    print(f"[testbed] {line}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The option parser (the command itself follows ``--`` and is split off before parsing)."""
    parser = _OneLineParser(
        prog=PROG,
        usage=f"{PROG} [options] -- COMMAND [ARG ...]  |  {PROG} --selftest[-cgroups]  |  {PROG} --cleanup",
        description="Run COMMAND on simulated nodes (Linux network namespaces) joined by rate-limited veth links, "
        "then write a JSON report of each node's wire bytes next to the byte ledger. Needs root, ip and tc.",
    )
    parser.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="processes per node (default 1)")
    parser.add_argument(
        "--bandwidth",
        default=None,
        help="rate of each node link, each direction, in tc syntax: 100mbit, 1gbit (10mbps means BYTES/s); "
        "'none' or omitted: unshaped",
    )
    parser.add_argument("--latency", default=None, help="one-way delay added on each node's uplink, e.g. 20ms (netem)")
    parser.add_argument(
        "--launch", choices=LAUNCH_MODES, default="per-rank", help="start every rank (default) or one process per node"
    )
    parser.add_argument("--master-port", type=int, default=29500, help="MASTER_PORT on node 0 (default 29500)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before everything is stopped (exit 124)")
    parser.add_argument(
        "--failure-grace",
        type=float,
        default=5.0,
        help="seconds the other processes get after one fails, before they are stopped (default 5)",
    )
    parser.add_argument(
        "--node-cpu",
        default=None,
        help="CPU quota of each node in cores, comma-separated (1.0,0.5), or one value for all; 'none' or an empty "
        "entry: unlimited (needs the cgroup cpu controller)",
    )
    parser.add_argument(
        "--node-memory",
        default=None,
        help="memory limit of each node, comma-separated (6G,1.5Gi), or one value for all; K/M/G/T are powers of "
        "1000, Ki/Mi/Gi/Ti of 1024; 'none' or an empty entry: unlimited (needs the cgroup memory controller)",
    )
    parser.add_argument("--report", default=None, help="report JSON path (default <run dir>/report.json)")
    parser.add_argument("--run-dir", default=None, help="folder for ledger dumps and the report (default: a temp dir)")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--selftest", action="store_true", help="check measured TCP rate at 50mbit and 200mbit")
    modes.add_argument(
        "--selftest-cgroups",
        action="store_true",
        help="check node cgroups: CPU work rates follow the quotas 1.0 and 0.5, a node past its memory limit is "
        "OOM-killed, nothing is left behind",
    )
    modes.add_argument(
        "--cleanup",
        action="store_true",
        help="remove lhtb-* namespaces and cgroups left by killed runs (live runs are kept)",
    )
    return parser


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``argv`` at the first ``--`` and parse the options; refuses (exit 2) on bad input."""
    if "--" in argv:
        split = argv.index("--")
        options, command = argv[:split], argv[split + 1 :]
    else:
        options, command = argv, []
    args = build_parser().parse_args(options)
    mode = "selftest" if args.selftest else "selftest-cgroups" if args.selftest_cgroups else "cleanup"
    if args.selftest or args.selftest_cgroups or args.cleanup:
        if command:
            _refuse(f"--{mode} takes no command; drop everything after '--'.")
    elif not command:
        _refuse("no command given; put it after '--', e.g. --nodes 2 --bandwidth 100mbit -- python train.py")
    if args.timeout is not None and args.timeout <= 0:
        _refuse(f"--timeout {args.timeout:g} must be positive; omit it for no limit.")
    if args.failure_grace < 0:
        _refuse(f"--failure-grace {args.failure_grace:g} must be >= 0 (e.g. 5).")
    return args, command


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args, command = parse_arguments(sys.argv[1:] if argv is None else argv)
    try:
        if args.cleanup:
            check_environment()
            removed = cleanup_leftover_cgroups(log=_say)  # first: a cgroup removal also ends its processes
            removed += cleanup_leftovers(log=_say)
            if not removed:
                print("[testbed] nothing to clean up", flush=True)
            return 0
        if args.selftest:
            from lightning_hetero.testbed.selftest import run_selftest

            check_environment()
            return 0 if run_selftest()["passed"] else 1
        if args.selftest_cgroups:
            from lightning_hetero.testbed.cgroup_selftest import run_cgroup_selftest

            check_environment(cgroup_controllers=("cpu", "memory"))
            return 0 if run_cgroup_selftest()["passed"] else 1
        bed = Testbed(
            nodes=args.nodes,
            ranks_per_node=args.ranks_per_node,
            bandwidth=args.bandwidth,
            latency=args.latency,
            run_dir=args.run_dir,
            master_port=args.master_port,
            node_cpu=args.node_cpu,
            node_memory=args.node_memory,
        )
        with bed:
            result = bed.run(
                command,
                launch=args.launch,
                timeout=args.timeout,
                report_path=args.report,
                failure_grace=args.failure_grace,
            )
        return result.exit_code
    except TestbedConfigError as error:
        _refuse(str(error))
    except TestbedInterrupted as interrupt:
        sys.stderr.write(f"[testbed] {interrupt}; stopped every process and removed the namespaces\n")
        return interrupt.exit_code
    except KeyboardInterrupt:
        return 130
    except TestbedError as error:
        sys.stderr.write(f"{PROG}: {error}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
