"""Report merging from synthetic counters and ledger dumps (exact numbers), and the ownership rules of cleanup."""

from __future__ import annotations

import json
import os

from lightning_hetero.comm import dump as comm_dump
from lightning_hetero.testbed import netns
from lightning_hetero.testbed.netns import InterfaceCounters
from lightning_hetero.testbed.report import REPORT_SCHEMA, build_report, node_ledger, write_report


def _dump(rank: int, node: int | None, inter: int, steps: dict[str, int]) -> dict:
    return {
        "rank": rank,
        "node_rank": node,
        "local_rank": 0,
        "pid": 100 + rank,
        "totals": {
            "inter": {"sent": inter, "received": inter, "calls": len(steps)},
            "intra": {"sent": 5, "received": 7, "calls": 1},
        },
        "steps": {step: {"inter": {"sent": b, "received": b, "calls": 1}} for step, b in steps.items()},
    }


DUMPS = [
    _dump(0, 0, 1000, {"0": 400, "1": 600}),
    _dump(1, 0, 2000, {"1": 2000}),
    _dump(2, None, 300, {"10": 300, "2": 0}),  # no node rank: placed by rank // ranks_per_node
    _dump(3, 1, 700, {"2": 700}),
]


def test_node_ledger_sums_ranks_labels_and_steps():
    ledger = node_ledger(DUMPS, node=0, ranks_per_node=2)
    assert ledger == {
        "ranks": [0, 1],
        "totals": {
            "intra": {"sent": 10, "received": 14, "calls": 2},
            "inter": {"sent": 3000, "received": 3000, "calls": 3},
        },
        "total": {"sent": 3010, "received": 3014, "calls": 5},
        "steps": {
            "0": {"inter": {"sent": 400, "received": 400, "calls": 1}},
            "1": {"inter": {"sent": 2600, "received": 2600, "calls": 2}},
        },
    }
    node1 = node_ledger(DUMPS, node=1, ranks_per_node=2)
    assert node1["ranks"] == [2, 3]
    assert list(node1["steps"]) == ["2", "10"]  # numeric order, not string order
    assert node1["steps"]["2"]["inter"] == {"sent": 700, "received": 700, "calls": 2}


def test_build_report_wire_deltas_and_ratios(tmp_path):
    before = [InterfaceCounters(100, 200, 1, 2), InterfaceCounters(0, 0, 0, 0)]
    after = [InterfaceCounters(3110, 3214, 51, 62), InterfaceCounters(0, 0, 0, 0)]
    report = build_report(
        run_id="abc123",
        config={"nodes": 2, "ranks_per_node": 2},
        node_addresses=["10.213.0.1", "10.213.0.2"],
        counters_before=before,
        counters_after=after,
        ledger_dumps=DUMPS[:2],
        processes=[{"name": "n0r0", "exit_status": 0}],
        exit_code=0,
        timed_out=False,
        elapsed_seconds=1.5,
        run_dir="/r",
        ledger_dir="/r/ledger",
    )
    assert report["schema"] == REPORT_SCHEMA and report["exit_code"] == 0 and report["run_id"] == "abc123"
    node0, node1 = report["nodes"]
    assert node0["address"] == "10.213.0.1"
    assert node0["wire"] == {"tx_bytes": 3010, "rx_bytes": 3014, "tx_packets": 50, "rx_packets": 60}
    assert node0["wire_over_ledger"] == {"tx_over_sent": 1.0, "rx_over_received": 1.0}
    assert node1["ledger"]["total"] == {"sent": 0, "received": 0, "calls": 0}
    assert node1["wire_over_ledger"] is None  # no ledger traffic: no ratio
    assert len(report["ledger_dumps"]) == 2
    path = write_report(report, tmp_path / "sub" / "report.json")
    assert json.loads(path.read_text()) == report


def test_ledger_dir_env_name_matches_the_dump_module():
    from lightning_hetero.testbed import launch

    assert launch.LEDGER_DIR_ENV is comm_dump.LEDGER_DIR_ENV  # the launcher sets the variable the dump reads
    assert comm_dump.LEDGER_DIR_ENV == "LIGHTNING_HETERO_LEDGER_DIR"


def test_owner_liveness(monkeypatch, tmp_path):
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path)
    netns._write_state("aaa111", ["lhtb-aaa111-sw"])
    assert netns._owner_alive("aaa111") == os.getpid()
    state = json.loads((tmp_path / "aaa111.json").read_text())
    (tmp_path / "bbb222.json").write_text(json.dumps(state | {"owner_start_ticks": state["owner_start_ticks"] + 1}))
    assert netns._owner_alive("bbb222") is None  # same pid, different start time: a recycled pid
    assert netns._owner_alive("ccc333") is None  # no state file


def test_cleanup_keeps_live_runs_and_removes_dead_ones(monkeypatch, tmp_path):
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path)
    netns._write_state("aaa111", ["lhtb-aaa111-n0"])  # owned by this (live) process
    (tmp_path / "dead00.json").write_text(json.dumps({"owner_pid": 2**22 + 1, "owner_start_ticks": 1}))
    names = ["lhtb-aaa111-n0", "lhtb-dead00-n0", "lhtb-dead00-sw", "lhtb-odd"]
    monkeypatch.setattr(netns, "list_testbed_namespaces", lambda: names)
    monkeypatch.setattr(netns, "_kill_namespace_processes", lambda namespace: [])
    deleted = []

    class Done:
        returncode = 0

    def fake_run(argv, check=True):
        assert argv[:3] == ["ip", "netns", "del"] and argv[3].startswith("lhtb-")
        deleted.append(argv[3])
        return Done()

    monkeypatch.setattr(netns, "_run", fake_run)
    lines = []
    assert netns.cleanup_leftovers(log=lines.append) == ["lhtb-dead00-n0", "lhtb-dead00-sw", "lhtb-odd"]
    assert deleted == ["lhtb-dead00-n0", "lhtb-dead00-sw", "lhtb-odd"]
    assert lines[0] == f"kept lhtb-aaa111-n0: its testbed (pid {os.getpid()}) is still running"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aaa111.json"]  # the dead run's state is gone
