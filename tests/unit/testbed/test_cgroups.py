"""Per-node cgroups without root: parsing, v1/v2 writes into a fake cgroup tree, usage, cleanup, report, environment.

The fake kernel is a tmp_path tree: ``_make_group_directory`` is replaced by one that creates the control files a
real kernel would show in a new group, and ``_remove_group_directory`` by ``shutil.rmtree``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from lightning_hetero.testbed import __main__ as cli
from lightning_hetero.testbed import bed, cgroups, checks, netns
from lightning_hetero.testbed.cgroups import (
    CgroupLayout,
    CgroupMount,
    CgroupUnavailable,
    CgroupUsage,
    NodeLimits,
    cleanup_leftover_cgroups,
    create_node_cgroups,
    join_command,
    read_cgroup_mounts,
    select_layout,
    view_command,
)
from lightning_hetero.testbed.checks import TestbedConfigError, parse_memory_size, parse_node_cpu, parse_node_memory
from lightning_hetero.testbed.launch import build_process_specs, node_environment, rank_environment
from lightning_hetero.testbed.netns import InterfaceCounters
from lightning_hetero.testbed.report import build_report, node_resources

V1_FILES = {
    "cpu": ["cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.shares", "cpu.stat"],
    "memory": ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.max_usage_in_bytes"]
    + ["memory.failcnt", "memory.oom_control"],
    "cpuacct": ["cpuacct.usage"],
}
V2_FILES = ["cpu.max", "cpu.weight", "cpu.stat", "memory.max", "memory.swap.max", "memory.peak", "memory.events"]


@pytest.fixture
def fake_kernel(monkeypatch):
    """New groups get the control files of their hierarchy (named by the base directory); removal is rmtree."""
    omitted: set[str] = set()

    def make(path: Path) -> None:
        path.mkdir()
        files = V2_FILES if path.parent.name == "unified" else V1_FILES[path.parent.name]
        for name in ["cgroup.procs", *files]:
            if name not in omitted:
                (path / name).write_text("")

    monkeypatch.setattr(cgroups, "_make_group_directory", make)
    monkeypatch.setattr(cgroups, "_remove_group_directory", shutil.rmtree)
    return omitted


def _v1_layout(root: Path) -> CgroupLayout:
    for name in ("cpu", "memory", "cpuacct"):
        (root / name).mkdir()
    return CgroupLayout(1, {"cpu": root / "cpu", "memory": root / "memory", "cpuacct": root / "cpuacct"})


def _v2_layout(root: Path) -> CgroupLayout:
    (root / "unified").mkdir()
    (root / "unified" / "cgroup.subtree_control").write_text("io\n")
    return CgroupLayout(2, {"unified": root / "unified"})


# -- parsing -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "nodes", "expected"),
    [
        ("1.0,0.5", 2, [1.0, 0.5]),
        ("1.5", 3, [1.5, 1.5, 1.5]),
        ("none,0.5", 2, [None, 0.5]),
        (",0.25", 2, [None, 0.25]),
        ([2, None], 2, [2.0, None]),
        (0.5, 2, [0.5, 0.5]),
        ("none", 2, None),
        (None, 2, None),
    ],
)
def test_parse_node_cpu(value, nodes, expected):
    assert parse_node_cpu(value, nodes) == expected


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("1,2,3", "has 3 values for 2 nodes"),
        ("-1,1", "at least 0.01 cores"),
        ("0", "at least 0.01 cores"),
        ("fast", "is not a number of cores"),
        ("nan", "at least 0.01 cores"),
    ],
)
def test_parse_node_cpu_refuses_in_one_line(value, needle):
    with pytest.raises(TestbedConfigError, match=needle) as error:
        parse_node_cpu(value, 2)
    assert "\n" not in str(error.value) and "--node-cpu" in str(error.value)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("6G", 6 * 10**9),
        ("1.5G", 1_500_000_000),
        ("1.5Gi", 3 * 2**29),
        ("512Mi", 512 * 2**20),
        ("64MiB", 64 * 2**20),
        ("8m", 8 * 10**6),
        ("10000000", 10**7),
        (2**30, 2**30),
    ],
)
def test_parse_memory_size(text, size):
    assert parse_memory_size(text) == size


def test_parse_node_memory_lists_and_unlimited_entries():
    assert parse_node_memory("6G,1.5G", 2) == [6 * 10**9, 1_500_000_000]
    assert parse_node_memory("none,64Mi", 2) == [None, 64 * 2**20]
    assert parse_node_memory("1Gi", 3) == [2**30] * 3
    assert parse_node_memory(["none", ""], 2) is None


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("6X", "is not a size"),
        ("6Gbit", "is not a size"),
        ("1k", "below the minimum"),
        ("-2G", "below the minimum"),
        ("0", "below the minimum"),
        ("1G,2G,3G", "has 3 values"),
    ],
)
def test_parse_node_memory_refuses_in_one_line(value, needle):
    with pytest.raises(TestbedConfigError, match=needle) as error:
        parse_node_memory(value, 2)
    assert "\n" not in str(error.value) and "--node-memory" in str(error.value)


# -- finding the hierarchies -------------------------------------------------------------------------------------------
def test_read_cgroup_mounts_and_select_layout(tmp_path):
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("hugetlb\n")
    mountinfo = "\n".join(
        [
            "24 18 0:21 / /sys rw - sysfs sysfs rw",
            f"30 25 0:26 / {tmp_path}/cpu rw,relatime shared:7 - cgroup cgroup rw,cpu",
            f"31 25 0:27 / {tmp_path}/cpuacct rw,relatime - cgroup cgroup rw,cpuacct",
            f"32 25 0:28 / {tmp_path}/memory rw,relatime - cgroup cgroup rw,memory",
            f"33 25 0:29 / {tmp_path}/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd",
            f"34 25 0:30 / {unified} rw,relatime - cgroup2 cgroup2 rw",
            f"35 25 0:28 / {tmp_path}/memory2 rw,relatime - cgroup cgroup rw,memory",  # same hierarchy again
        ]
    )
    mounts = read_cgroup_mounts(mountinfo)
    assert [(m.version, m.path.name, sorted(m.controllers)) for m in mounts] == [
        (1, "cpu", ["cpu"]),
        (1, "cpuacct", ["cpuacct"]),
        (1, "memory", ["memory"]),
        (2, "unified", ["hugetlb"]),
    ]
    layout = select_layout(["cpu", "memory"], mounts)
    assert layout.version == 1
    assert layout.bases == {"cpu": tmp_path / "cpu", "memory": tmp_path / "memory", "cpuacct": tmp_path / "cpuacct"}
    # A v2 root offering both controllers wins.
    (unified / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert select_layout(["cpu", "memory"], read_cgroup_mounts(mountinfo)) == CgroupLayout(2, {"unified": unified})


def test_select_layout_names_the_missing_controller(tmp_path):
    mounts = [CgroupMount(1, tmp_path / "cpu", frozenset({"cpu"})), CgroupMount(2, tmp_path, frozenset())]
    with pytest.raises(CgroupUnavailable, match=r"controller\(s\) memory not available.*cgroup v2 root"):
        select_layout(["cpu", "memory"], mounts)
    assert select_layout(["cpu"], mounts).bases == {"cpu": tmp_path / "cpu"}  # cpuacct is optional


def test_check_environment_refuses_missing_controller(monkeypatch):
    monkeypatch.setattr(checks.os, "geteuid", lambda: 0)
    monkeypatch.setattr(checks.shutil, "which", lambda tool: f"/sbin/{tool}")
    monkeypatch.setattr(cgroups, "read_cgroup_mounts", lambda mountinfo=None: [])
    with pytest.raises(TestbedConfigError, match="memory not available.*rerun without --node-memory") as error:
        checks.check_environment(cgroup_controllers=["memory"])
    assert "\n" not in str(error.value)


# -- creating, limiting, reading, removing -----------------------------------------------------------------------------
def test_v1_groups_get_quota_shares_and_memory_limits(tmp_path, fake_kernel):
    layout = _v1_layout(tmp_path)
    run = create_node_cgroups("abc123", [NodeLimits(1.0, None), NodeLimits(0.5, 64 * 2**20)], layout)
    node0, node1 = (tmp_path / "cpu" / "lhtb-abc123-n0", tmp_path / "cpu" / "lhtb-abc123-n1")
    assert (node0 / "cpu.cfs_quota_us").read_text() == "100000" and (node0 / "cpu.shares").read_text() == "4096"
    assert (node1 / "cpu.cfs_quota_us").read_text() == "50000" and (node1 / "cpu.cfs_period_us").read_text() == "100000"
    memory1 = tmp_path / "memory" / "lhtb-abc123-n1"
    assert (memory1 / "memory.limit_in_bytes").read_text() == str(64 * 2**20)
    assert (memory1 / "memory.memsw.limit_in_bytes").read_text() == str(64 * 2**20)  # swap cannot dodge the limit
    assert (tmp_path / "memory" / "lhtb-abc123-n0" / "memory.limit_in_bytes").read_text() == ""  # unlimited
    assert run.procs_files(1) == [str(tmp_path / name / "lhtb-abc123-n1" / "cgroup.procs") for name in V1_FILES]
    assert sorted(run.remove()) == sorted(str(tmp_path / c / f"lhtb-abc123-n{k}") for c in V1_FILES for k in (0, 1))
    assert not list(tmp_path.glob("*/lhtb-*"))


def test_v1_without_swap_accounting_skips_memsw(tmp_path, fake_kernel):
    fake_kernel.add("memory.memsw.limit_in_bytes")
    create_node_cgroups("abc123", [NodeLimits(None, 2**30)], _v1_layout(tmp_path))
    assert not (tmp_path / "memory" / "lhtb-abc123-n0" / "memory.memsw.limit_in_bytes").exists()


def test_v2_groups_enable_controllers_and_write_limits(tmp_path, fake_kernel):
    layout = _v2_layout(tmp_path)
    run = create_node_cgroups("abc123", [NodeLimits(1.5, 6 * 10**9), NodeLimits(0.25, None)], layout)
    root = tmp_path / "unified"
    assert (root / "cgroup.subtree_control").read_text() == "+cpu +memory"
    node0, node1 = root / "lhtb-abc123-n0", root / "lhtb-abc123-n1"
    assert (node0 / "cpu.max").read_text() == "150000 100000" and (node0 / "cpu.weight").read_text() == "600"
    assert (node0 / "memory.max").read_text() == "6000000000" and (node0 / "memory.swap.max").read_text() == "0"
    assert (node1 / "cpu.max").read_text() == "25000 100000" and (node1 / "memory.max").read_text() == ""
    assert run.procs_files(0) == [str(node0 / "cgroup.procs")]
    assert run.remove() == [str(node1), str(node0)] and not node0.exists()


def test_failed_creation_removes_what_was_made(tmp_path, fake_kernel):
    layout = _v1_layout(tmp_path)
    (tmp_path / "cpu" / "lhtb-abc123-n1").mkdir()  # node 1's directory already exists: mkdir fails
    with pytest.raises(netns.TestbedError, match="cannot create cgroup .*lhtb-abc123-n1"):
        create_node_cgroups("abc123", [NodeLimits(1.0, None), NodeLimits(0.5, None)], layout)
    assert sorted(p.name for p in tmp_path.glob("*/lhtb-*")) == ["lhtb-abc123-n1"]  # only the foreign one is left


def test_usage_v1_and_v2(tmp_path, fake_kernel):
    run1 = create_node_cgroups("aaa111", [NodeLimits(0.5, 2**30)], _v1_layout(tmp_path))
    group = run1.groups[0]
    (group.directories["cpuacct"] / "cpuacct.usage").write_text("1500000000\n")
    (group.directories["cpu"] / "cpu.stat").write_text("nr_periods 40\nnr_throttled 30\nthrottled_time 2000000000\n")
    memory = group.directories["memory"]
    (memory / "memory.max_usage_in_bytes").write_text("67108864\n")
    (memory / "memory.failcnt").write_text("12\n")
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert group.usage() == CgroupUsage(1.5, 30, 2.0, 67108864, 12, 1)
    group.reset_peak()
    assert (memory / "memory.max_usage_in_bytes").read_text() == "0"
    run2 = create_node_cgroups("bbb222", [NodeLimits(0.5, 2**30)], _v2_layout(tmp_path))
    directory = run2.groups[0].directories["unified"]
    (directory / "cpu.stat").write_text(
        "usage_usec 2500000\nuser_usec 2400000\nnr_throttled 7\nthrottled_usec 500000\n"
    )
    (directory / "memory.peak").write_text("1048576\n")
    (directory / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\noom_group_kill 0\n")
    usage = run2.groups[0].usage()
    assert usage == CgroupUsage(2.5, 7, 0.5, 1048576, 5, 1)
    assert usage.since(CgroupUsage(0.5, 2, 0.25, 99, 1, 0)) == CgroupUsage(2.0, 5, 0.25, 1048576, 4, 1)


def test_cleanup_removes_groups_of_dead_runs_only(monkeypatch, tmp_path, fake_kernel):
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path / "state")
    netns._write_state("aaa111", [])  # owned by this (live) process
    layout = _v1_layout(tmp_path)
    create_node_cgroups("aaa111", [NodeLimits(0.5, None)], layout)
    create_node_cgroups("dead00", [NodeLimits(0.5, None), NodeLimits(None, 2**30)], layout)
    (tmp_path / "cpu" / "other").mkdir()  # not ours: never touched
    mounts = [CgroupMount(1, tmp_path / name, frozenset({name})) for name in V1_FILES]
    lines = []
    removed = cleanup_leftover_cgroups(log=lines.append, mounts=mounts)
    assert sorted(Path(path).name for path in removed) == ["lhtb-dead00-n0"] * 3 + ["lhtb-dead00-n1"] * 3
    assert lines[0] == f"kept cgroup lhtb-aaa111-n0: its testbed (pid {os.getpid()}) is still running"
    assert sorted(p.name for p in tmp_path.glob("*/*") if p.is_dir()) == ["lhtb-aaa111-n0"] * 3 + ["other"]


def test_join_command_moves_the_process_before_exec(tmp_path):
    procs = [tmp_path / "a.procs", tmp_path / "b.procs"]
    argv = join_command([str(path) for path in procs], ["sh", "-c", "echo $$"])
    assert argv[:2] == ["sh", "-c"] and argv[-3:] == ["sh", "-c", "echo $$"]
    printed = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
    assert [path.read_text().strip() for path in procs] == [printed, printed]  # the same pid before and after exec
    assert join_command([], ["true"]) == ["true"]


def test_join_command_refuses_to_run_outside_the_group(tmp_path):
    marker = tmp_path / "ran"
    argv = join_command([str(tmp_path / "missing" / "cgroup.procs")], ["touch", str(marker)])
    completed = subprocess.run(argv, capture_output=True, text=True)
    assert completed.returncode == cgroups.JOIN_FAILED_EXIT_CODE and "cannot join the node cgroup" in completed.stderr
    assert not marker.exists()


def test_view_command_mounts_the_run_hierarchies_again_before_exec():
    v1 = CgroupLayout(1, {"cpu": Path("/sys/fs/cgroup/cpu"), "memory": Path("/sys/fs/cgroup/memory")})
    argv = view_command(v1, ["python", "train.py"])
    script = argv[2]
    assert argv[:2] == ["sh", "-c"] and argv[-2:] == ["python", "train.py"]
    assert script.index("mount -t tmpfs lhtb-cgroups /sys/fs/cgroup") < script.index("-o memory")
    assert "mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu" in script
    assert "mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory" in script
    assert script.endswith('exec "$@"')  # a failed mount still runs the command, inside its limits
    shared = CgroupLayout(1, {"cpu": Path("/cg/cpu,cpuacct"), "cpuacct": Path("/cg/cpu,cpuacct")})
    assert "-o cpu,cpuacct cgroup /cg/cpu,cpuacct" in view_command(shared, ["true"])[2]
    v2 = view_command(CgroupLayout(2, {"unified": Path("/sys/fs/cgroup")}), ["true"])[2]
    assert "mount -t cgroup2 none /sys/fs/cgroup" in v2 and "tmpfs" not in v2


# -- launch environment, report, CLI -----------------------------------------------------------------------------------
def test_omp_threads_follow_the_quota_unless_set():
    common = dict(nodes=2, master_addr="10.213.0.1", master_port=29500, ledger_dir="/x", cpu_count=16)
    assert (
        rank_environment({}, ranks_per_node=1, node_rank=0, local_rank=0, run_id="a", cpu_quota=1.5, **common)[
            "OMP_NUM_THREADS"
        ]
        == "2"
    )
    assert node_environment({}, ranks_per_node=2, node_rank=1, cpu_quota=0.5, **common)["OMP_NUM_THREADS"] == "1"
    assert node_environment({}, ranks_per_node=2, node_rank=1, cpu_quota=4.0, **common)["OMP_NUM_THREADS"] == "2"
    assert node_environment({}, ranks_per_node=1, node_rank=0, **common)["OMP_NUM_THREADS"] == "8"  # no quota
    user = {"OMP_NUM_THREADS": "3"}
    assert node_environment(user, ranks_per_node=1, node_rank=0, cpu_quota=0.5, **common)["OMP_NUM_THREADS"] == "3"


def test_process_specs_join_their_node_group():
    specs = build_process_specs(
        ["python", "x.py"],
        launch="per-rank",
        namespaces=["lhtb-a-n0", "lhtb-a-n1"],
        ranks_per_node=1,
        master_addr="10.213.0.1",
        master_port=29500,
        ledger_dir="/x",
        run_id="a",
        base_env={},
        cpu_count=2,
        node_cpu=[1.0, 0.5],
        node_cgroup_procs=[["/cg/cpu/lhtb-a-n0/cgroup.procs"], ["/cg/cpu/lhtb-a-n1/cgroup.procs"]],
    )
    assert specs[1].argv[:2] == ["sh", "-c"] and "/cg/cpu/lhtb-a-n1/cgroup.procs" in specs[1].argv[2]
    assert specs[1].argv[-6:] == ["ip", "netns", "exec", "lhtb-a-n1", "python", "x.py"]
    assert [spec.env["OMP_NUM_THREADS"] for spec in specs] == ["1", "1"]


def test_report_carries_node_limits_and_usage():
    usage = CgroupUsage(1.5, 30, 1.4, 2**26, 3, 1).to_dict()
    resources = [
        node_resources(cpu_quota=1.0, memory_limit_bytes=None, cgroup_version=1, cgroup_name="lhtb-a-n0"),
        node_resources(cpu_quota=0.5, memory_limit_bytes=2**26, cgroup_version=1, cgroup_name="lhtb-a-n1", usage=usage),
    ]
    common = dict(
        run_id="a",
        config={"ranks_per_node": 1},
        node_addresses=["10.213.0.1", "10.213.0.2"],
        counters_before=[InterfaceCounters()] * 2,
        counters_after=[InterfaceCounters()] * 2,
        ledger_dumps=[],
        processes=[],
        exit_code=137,
        timed_out=False,
        elapsed_seconds=1.0,
        run_dir="/r",
        ledger_dir="/r/l",
    )
    nodes = build_report(resources=resources, **common)["nodes"]
    assert nodes[1]["cpu_quota"] == 0.5 and nodes[1]["memory_limit_bytes"] == 2**26
    assert nodes[1]["cgroup"] == {"version": 1, "name": "lhtb-a-n1", **usage}
    assert nodes[0]["cgroup"] == {"version": 1, "name": "lhtb-a-n0"}
    plain = build_report(**common)["nodes"][0]
    assert (plain["cpu_quota"], plain["memory_limit_bytes"], plain["cgroup"]) == (None, None, None)
    json.dumps(nodes)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nodes", "3", "--node-cpu", "1,0.5", "--", "true"], "--node-cpu has 2 values for 3 nodes"),
        (["--node-memory=-1G", "--", "true"], "--node-memory entry '-1G' is below the minimum of 4Mi"),
        (["--node-memory", "2Q", "--", "true"], "--node-memory entry '2Q' is not a size"),
        (["--selftest-cgroups", "--", "true"], "--selftest-cgroups takes no command"),
        (["--selftest-cgroups", "--cleanup"], "not allowed with argument"),
    ],
)
def test_cli_refusals_are_one_line(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr(bed, "create_topology", lambda *a, **k: pytest.fail("created something"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and needle in err, err


def test_cli_refuses_missing_controller_before_creating_anything(capsys, monkeypatch):
    monkeypatch.setattr(bed, "create_topology", lambda *a, **k: pytest.fail("created something"))
    monkeypatch.setattr(checks.os, "geteuid", lambda: 0)
    monkeypatch.setattr(checks.shutil, "which", lambda tool: f"/sbin/{tool}")
    monkeypatch.setattr(cgroups, "read_cgroup_mounts", lambda mountinfo=None: [])
    with pytest.raises(SystemExit):
        cli.main(["--node-cpu", "0.5", "--", "true"])
    err = capsys.readouterr().err
    assert "cgroup controller(s) cpu not available" in err and "rerun without --node-cpu" in err
    assert err.count("\n") == 1
