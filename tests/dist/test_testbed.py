"""The bandwidth testbed for real: namespaces, shaped veth links, gloo all_reduce, failures, SIGKILL and --cleanup.

Skipped (with the reason) unless running as root with iproute2 on a kernel that lets us create network namespaces.
Each test checks that the namespaces it created are gone afterwards; namespaces of other runs are left alone.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_hetero.testbed import Testbed, list_testbed_namespaces
from lightning_hetero.testbed.netns import namespace_pids
from tests.testbed_support import require_testbed

PROBE = [sys.executable, "-m", "lightning_hetero.testbed.probe"]
CLI = [sys.executable, "-m", "lightning_hetero.testbed"]
#: float32 payload of the probe's all_reduce: 1e6 elements = 4 MB.
NUMEL = 1_000_000
STEPS = 3
#: Wire bytes over ledger bytes on a 2-node all_reduce: observed 1.047-1.053 (1514-byte frames carrying 1448 payload
#: bytes = 1.0456, plus ACKs, gloo's handshakes and the TCPStore rendezvous).
WIRE_OVER_LEDGER = (1.0, 1.15)


@pytest.fixture(scope="module", autouse=True)
def _needs_namespaces():
    require_testbed(probe_namespaces=True)


@pytest.fixture
def own_namespaces():
    """Yields a function listing the lhtb- namespaces created since the test began; asserts none remain at the end."""
    before = set(list_testbed_namespaces())
    yield lambda: sorted(set(list_testbed_namespaces()) - before)
    leftovers = sorted(set(list_testbed_namespaces()) - before)
    assert not leftovers, f"the test left namespaces behind: {leftovers}"


@pytest.mark.timeout(120)
def test_all_reduce_wire_bytes_match_the_ledger(tmp_path, own_namespaces):
    output = io.StringIO()
    with Testbed(nodes=2, ranks_per_node=1, bandwidth="100mbit", run_dir=tmp_path, log=output) as bed:
        assert len(own_namespaces()) == 3  # switch + 2 nodes
        result = bed.run([*PROBE, "--numel", str(NUMEL), "--steps", str(STEPS)], timeout=90, output=output)
    assert result.exit_code == 0, output.getvalue()
    assert own_namespaces() == []
    report = result.report
    assert result.report_path == tmp_path / "report.json" and result.report_path.exists()
    assert report["config"]["bits_per_second"] == 1e8 and report["config"]["launch"] == "per-rank"
    payload = 4 * NUMEL
    expected = STEPS * 2 * (2 - 1) * payload // 2  # the ledger's all_reduce rule, n = 2
    for node in report["nodes"]:
        ledger = node["ledger"]
        assert ledger["totals"] == {"inter": {"sent": expected, "received": expected, "calls": STEPS}}
        assert list(ledger["steps"]) == [str(step) for step in range(STEPS)]
        tx_ratio = node["wire_over_ledger"]["tx_over_sent"]
        rx_ratio = node["wire_over_ledger"]["rx_over_received"]
        assert node["wire"]["tx_bytes"] / expected == tx_ratio
        low, high = WIRE_OVER_LEDGER
        assert low <= tx_ratio <= high and low <= rx_ratio <= high, (tx_ratio, rx_ratio)
    # What one node sends the other receives, byte for byte (the switch adds nothing).
    node0, node1 = (node["wire"] for node in report["nodes"])
    assert abs(node0["tx_bytes"] - node1["rx_bytes"]) < 200 and abs(node1["tx_bytes"] - node0["rx_bytes"]) < 200


@pytest.mark.timeout(120)
def test_failing_rank_stops_the_run_promptly(tmp_path, own_namespaces):
    start = time.monotonic()
    completed = subprocess.run(
        [*CLI, "--nodes", "2", "--bandwidth", "100mbit", "--run-dir", str(tmp_path), "--timeout", "90"]
        + ["--", *PROBE, "--fail-rank", "1", "--fail-code", "3"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert completed.returncode == 3, completed.stdout + completed.stderr
    assert time.monotonic() - start < 40
    assert "[n1r1] rank 1: failing on purpose with exit code 3" in completed.stdout
    assert own_namespaces() == []


@pytest.mark.timeout(120)
def test_sigkilled_run_leaves_namespaces_that_cleanup_removes(tmp_path, own_namespaces):
    foreign_before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    testbed = subprocess.Popen(
        [*CLI, "--nodes", "2", "--bandwidth", "10mbit", "--run-dir", str(tmp_path)]
        + ["--", *PROBE, "--steps", "1000", "--timeout", "300"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            mine = own_namespaces()
            if len(mine) == 3 and all(namespace_pids(name) for name in mine if not name.endswith("-sw")):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the testbed never started its ranks; namespaces: {own_namespaces()}")
    finally:
        testbed.send_signal(signal.SIGKILL)
        testbed.wait()
    leftovers = own_namespaces()
    assert len(leftovers) == 3  # SIGKILL gives no chance to clean up
    orphans = [pid for name in leftovers for pid in namespace_pids(name)]
    assert orphans  # the ranks outlived their testbed
    cleaned = subprocess.run([*CLI, "--cleanup"], capture_output=True, text=True, timeout=60)
    assert cleaned.returncode == 0, cleaned.stderr
    for name in leftovers:
        assert f"removed {name}" in cleaned.stdout
    assert own_namespaces() == []
    for pid in orphans:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split(")")[1][:3]
    foreign_after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    non_testbed = [line for line in foreign_before.splitlines() if not line.startswith("lhtb-")]
    assert [line for line in foreign_after.splitlines() if not line.startswith("lhtb-")] == non_testbed


@pytest.mark.timeout(120)
def test_selftest_passes(own_namespaces):
    start = time.monotonic()
    completed = subprocess.run([*CLI, "--selftest"], capture_output=True, text=True, timeout=110)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "PASS 50mbit" in completed.stdout and "PASS 200mbit" in completed.stdout
    assert time.monotonic() - start < 60
