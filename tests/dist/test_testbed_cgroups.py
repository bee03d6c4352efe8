"""Node cgroups for real: the self-test (CPU quota ratio, OOM kill, nothing left), inheritance, SIGKILL and --cleanup.

Skipped (with the reason) unless running as root with iproute2, network namespaces and the cgroup ``cpu`` and
``memory`` controllers. Each test checks that the groups and namespaces it created are gone afterwards.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_hetero.testbed import Testbed, list_testbed_cgroups, list_testbed_namespaces
from lightning_hetero.testbed.checks import TestbedConfigError, check_environment
from tests.testbed_support import require_testbed

CLI = [sys.executable, "-m", "lightning_hetero.testbed"]


@pytest.fixture(scope="module", autouse=True)
def _needs_cgroups():
    require_testbed(probe_namespaces=True)
    try:
        check_environment(cgroup_controllers=("cpu", "memory"))
    except TestbedConfigError as error:
        pytest.skip(str(error))


@pytest.fixture
def own_groups():
    """Yields a function listing the lhtb- groups created since the test began; asserts none remain at the end."""
    before = set(list_testbed_cgroups())
    yield lambda: sorted(set(list_testbed_cgroups()) - before)
    leftovers = sorted(set(list_testbed_cgroups()) - before)
    assert not leftovers, f"the test left cgroups behind: {leftovers}"


def _selftest_report(stdout: str) -> dict:
    """The self-test's JSON report (between the testbed's log lines and its PASS/FAIL verdicts)."""
    return json.loads(stdout[stdout.index("\n{") + 1 : stdout.rindex("\n}") + 2])


@pytest.mark.timeout(90)
def test_selftest_cgroups_passes(own_groups):
    completed = subprocess.run([*CLI, "--selftest-cgroups"], capture_output=True, text=True, timeout=40)
    if completed.returncode != 0 and "FAIL cpu:" in completed.stdout and "FAIL memory" not in completed.stdout:
        # The work-rate ratio is wall-clock based (a benchmark number): with the rest of the suite on the 2 cores it
        # can miss 10% (2.40 for 2.0 once, while the kernel's CPU-time ratio was 1.91). Try again; if it misses again,
        # hold the test to what the kernel enforces, the CPU seconds each group was allowed (docs/testbed.md).
        completed = subprocess.run([*CLI, "--selftest-cgroups"], capture_output=True, text=True, timeout=40)
        if completed.returncode != 0 and "FAIL memory" not in completed.stdout:
            cpu = _selftest_report(completed.stdout)["cpu"]
            assert cpu["cpu_seconds_ratio"] == pytest.approx(cpu["expected_ratio"], rel=0.1), completed.stdout
            assert all(periods > 0 for periods in cpu["throttled_periods"]), completed.stdout  # the quota bit
            assert "PASS memory:" in completed.stdout and "PASS leftovers: none" in completed.stdout, completed.stdout
            assert own_groups() == []
            return
    assert completed.returncode == 0, completed.stdout + completed.stderr
    for verdict in ("PASS cpu:", "PASS memory:", "PASS leftovers: none"):
        assert verdict in completed.stdout, completed.stdout
    assert own_groups() == []


@pytest.mark.timeout(60)
def test_children_inherit_the_node_group_and_limits(tmp_path, own_groups):
    output = io.StringIO()
    command = ["sh", "-c", 'sh -c "grep lhtb- /proc/self/cgroup"; echo omp=$OMP_NUM_THREADS']
    with Testbed(nodes=2, node_cpu=[1.5, 0.5], node_memory=["none", "256Mi"], run_dir=tmp_path, log=output) as bed:
        assert sorted({group.name for group in own_groups()}) == [f"lhtb-{bed.run_id}-n0", f"lhtb-{bed.run_id}-n1"]
        result = bed.run(command, output=output, timeout=30)
        run_id = bed.run_id
    text = output.getvalue()
    assert result.exit_code == 0, text
    for node in (0, 1):  # the grandchild (sh -> sh -> grep) is in its node's group, in every hierarchy
        lines = [line for line in text.splitlines() if line.startswith(f"[n{node}r{node}] ") and "lhtb-" in line]
        assert lines and all(line.endswith(f"/lhtb-{run_id}-n{node}") for line in lines), text
    assert "[n0r0] omp=2" in text and "[n1r1] omp=1" in text
    nodes = result.report["nodes"]
    assert [node["cpu_quota"] for node in nodes] == [1.5, 0.5]
    assert [node["memory_limit_bytes"] for node in nodes] == [None, 256 * 2**20]
    assert all(node["cgroup"]["oom_kills"] == 0 and node["cgroup"]["cpu_seconds"] is not None for node in nodes)
    assert result.report["config"]["cgroup_version"] in (1, 2)
    assert own_groups() == [] and not [n for n in list_testbed_namespaces() if n.startswith(f"lhtb-{run_id}-")]


@pytest.mark.timeout(60)
def test_a_node_process_reads_its_own_memory_limit_and_charge(tmp_path, own_groups):
    """Inside the namespace the cgroup hierarchies are mounted again: measure sees the limit, as on a real node."""
    output = io.StringIO()
    probe = (
        "import torch; from lightning_hetero.hetero import measure; cpu = torch.device('cpu');"
        "print('limit', measure.memory_limit_bytes(cpu), 'peak>0', measure.peak_memory_bytes(cpu) > 0,"
        "'own', measure._limited_cgroup_peak_file() is not None)"
    )
    with Testbed(nodes=2, node_memory=["none", "900Mi"], run_dir=tmp_path, log=output) as bed:
        result = bed.run([sys.executable, "-c", probe], output=output, timeout=50)
    text = output.getvalue()
    assert result.exit_code == 0, text
    assert "[n0r0] limit None peak>0 True own False" in text, text
    assert f"[n1r1] limit {900 * 2**20} peak>0 True own True" in text, text
    assert own_groups() == []


def _group_members(groups) -> list[int]:
    pids = set()
    for group in groups:
        try:
            pids.update(int(token) for token in (group / "cgroup.procs").read_text().split())
        except OSError:
            continue
    return sorted(pids)


@pytest.mark.timeout(60)
def test_sigkilled_run_leaves_groups_that_cleanup_removes(tmp_path, own_groups):
    testbed = subprocess.Popen(
        [*CLI, "--nodes", "2", "--node-cpu", "0.5", "--node-memory", "256Mi", "--run-dir", str(tmp_path)]
        + ["--", "sleep", "300"],  # a placeholder workload that outlives its testbed
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            mine = own_groups()
            if len(mine) >= 4 and len(_group_members(mine)) >= 2:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the testbed never started its ranks in their groups; groups: {own_groups()}")
    finally:
        testbed.send_signal(signal.SIGKILL)
        testbed.wait()
    leftovers = own_groups()
    orphans = _group_members(leftovers)
    assert leftovers and len(orphans) >= 2  # SIGKILL gives no chance to clean up; the ranks outlived the testbed
    cleaned = subprocess.run([*CLI, "--cleanup"], capture_output=True, text=True, timeout=40)
    assert cleaned.returncode == 0, cleaned.stderr
    for group in leftovers:
        assert f"removed cgroup {group}" in cleaned.stdout
    assert own_groups() == []
    for pid in orphans:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split(")")[1][:3]
    run_id = leftovers[0].name.split("-")[1]
    assert not [name for name in list_testbed_namespaces() if name.startswith(f"lhtb-{run_id}-")]
