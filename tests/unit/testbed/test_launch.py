"""Per-rank and per-node environments (exact), exit-code rules, and the process supervisor on local processes."""

from __future__ import annotations

import io
import sys
import time
from dataclasses import dataclass

import pytest

from lightning_hetero.testbed.launch import (
    TIMEOUT_EXIT_CODE,
    ProcessSpec,
    build_process_specs,
    exit_status,
    node_environment,
    rank_environment,
    run_processes,
    worst_exit_code,
)

BASE = {
    "PATH": "/usr/bin",
    "HOME": "/root",
    "RANK": "7",
    "MASTER_PORT": "1",
    "TORCHELASTIC_RUN_ID": "x",
    "SLURM_JOB_ID": "9",
}
TOPOLOGY = {
    "nodes": 2,
    "ranks_per_node": 2,
    "master_addr": "10.213.0.1",
    "master_port": 29500,
    "ledger_dir": "/r/ledger",
}


def test_rank_environment_is_exact():
    env = rank_environment(BASE, node_rank=1, local_rank=1, run_id="abc123", cpu_count=8, **TOPOLOGY)
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "MASTER_ADDR": "10.213.0.1",
        "MASTER_PORT": "29500",
        "NODE_RANK": "1",
        "NNODES": "2",
        "GLOO_SOCKET_IFNAME": "eth0",
        "LIGHTNING_HETERO_LEDGER_DIR": "/r/ledger",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "2",
        "WORLD_SIZE": "4",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "TORCHELASTIC_RUN_ID": "lhtb-abc123",
    }


def test_node_environment_is_exact():
    env = node_environment(BASE, node_rank=0, cpu_count=2, **TOPOLOGY)
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "MASTER_ADDR": "10.213.0.1",
        "MASTER_PORT": "29500",
        "NODE_RANK": "0",
        "NNODES": "2",
        "GLOO_SOCKET_IFNAME": "eth0",
        "LIGHTNING_HETERO_LEDGER_DIR": "/r/ledger",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",  # 2 cpus // 4 ranks, at least 1
        "NPROC_PER_NODE": "2",
    }


def test_caller_omp_threads_win():
    env = rank_environment({"OMP_NUM_THREADS": "3"}, node_rank=0, local_rank=0, run_id="a", cpu_count=64, **TOPOLOGY)
    assert env["OMP_NUM_THREADS"] == "3"


def test_build_process_specs_per_rank_and_per_node():
    common = {"namespaces": ["lhtb-a-n0", "lhtb-a-n1"], "ranks_per_node": 2, "master_addr": "10.213.0.1"}
    common |= {"master_port": 29500, "ledger_dir": "/l", "run_id": "a", "base_env": {}, "cpu_count": 4}
    specs = build_process_specs(["python", "x.py"], launch="per-rank", **common)
    assert [(s.name, s.node, s.rank, s.local_rank, s.namespace) for s in specs] == [
        ("n0r0", 0, 0, 0, "lhtb-a-n0"),
        ("n0r1", 0, 1, 1, "lhtb-a-n0"),
        ("n1r2", 1, 2, 0, "lhtb-a-n1"),
        ("n1r3", 1, 3, 1, "lhtb-a-n1"),
    ]
    assert specs[3].argv == ["ip", "netns", "exec", "lhtb-a-n1", "python", "x.py"]
    nodes = build_process_specs(["torchrun"], launch="per-node", **common)
    assert [(s.name, s.rank, s.env["NODE_RANK"], "RANK" in s.env) for s in nodes] == [
        ("n0", None, "0", False),
        ("n1", None, "1", False),
    ]


def test_exit_codes():
    assert exit_status(0) == 0 and exit_status(3) == 3 and exit_status(-9) == 137 and exit_status(-15) == 143
    assert worst_exit_code([0, 0]) == 0
    assert worst_exit_code([0, 1, 3]) == 3
    assert worst_exit_code([1, 139]) == 139  # a crash by signal outranks a plain error
    assert worst_exit_code([]) == 0


@dataclass(frozen=True)
class LocalSpec(ProcessSpec):
    """Runs the command directly (no namespace), to test the supervisor without root."""

    @property
    def argv(self) -> list[str]:
        return list(self.command)


def _spec(name: str, code: str) -> LocalSpec:
    return LocalSpec(name, 0, None, None, "-", (sys.executable, "-c", code), {"PATH": "/usr/bin"})


def test_output_is_prefixed_and_success_is_zero():
    output = io.StringIO()
    outcome = run_processes([_spec("n0r0", "print('a'); print('b')"), _spec("n1r1", "print('c')")], output=output)
    assert outcome.exit_code == 0 and not outcome.timed_out
    assert sorted(output.getvalue().splitlines()) == ["[n0r0] a", "[n0r0] b", "[n1r1] c"]
    assert [p.exit_status for p in outcome.processes] == [0, 0]


def test_failure_stops_the_others_and_returns_the_failing_code():
    start = time.monotonic()
    specs = [_spec("n0r0", "import time; time.sleep(30)"), _spec("n1r1", "raise SystemExit(3)")]
    outcome = run_processes(specs, output=io.StringIO(), failure_grace=0.2)
    assert outcome.exit_code == 3
    assert time.monotonic() - start < 10
    hung, failed = outcome.processes
    assert hung.stopped_by_testbed and hung.exit_status == 143  # SIGTERM
    assert not failed.stopped_by_testbed and failed.exit_status == 3


def test_timeout_returns_124():
    outcome = run_processes([_spec("n0r0", "import time; time.sleep(30)")], output=io.StringIO(), timeout=0.3)
    assert outcome.exit_code == TIMEOUT_EXIT_CODE and outcome.timed_out
    assert outcome.processes[0].stopped_by_testbed


def test_unknown_launch_mode():
    with pytest.raises(ValueError, match="launch must be one of"):
        build_process_specs(
            ["x"],
            launch="per-host",
            namespaces=["n"],
            ranks_per_node=1,
            master_addr="a",
            master_port=1,
            ledger_dir="l",
            run_id="r",
            base_env={},
            cpu_count=1,
        )
