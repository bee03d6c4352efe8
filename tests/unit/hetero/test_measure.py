"""What a rank measures about itself: cgroup memory limits (v1 and v2, fake trees), peak memory, call timing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_hetero.hetero import measure
from lightning_hetero.hetero.measure import memory_limit_bytes, peak_memory_bytes, reset_peak_memory, time_call

CPU = torch.device("cpu")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_limit_is_the_smallest_along_the_path(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/testbed/slow\n3:cpu,cpuacct:/testbed/slow\n0::/\n")
    root = tmp_path / "fs"
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # unlimited
    _write(root / "memory" / "testbed" / "memory.limit_in_bytes", str(8 * 2**30))
    _write(root / "memory" / "testbed" / "slow" / "memory.limit_in_bytes", str(2 * 2**30))
    assert measure._cgroup_limit(proc, root) == 2 * 2**30


def test_cgroup_v1_inside_a_container_falls_back_to_the_mount_root(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/host/path/not/mounted\n")
    root = tmp_path / "fs"
    _write(root / "memory" / "memory.limit_in_bytes", str(3 * 2**30))
    assert measure._cgroup_limit(proc, root) == 3 * 2**30
    _write(root / "memory" / "memory.limit_in_bytes", str(2**62))
    assert measure._cgroup_limit(proc, root) is None  # >= 2**60: unlimited


def test_cgroup_v2_memory_max(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job\n")
    root = tmp_path / "fs"
    _write(root / "user.slice" / "job" / "memory.max", "max\n")
    assert measure._cgroup_limit(proc, root) is None
    _write(root / "user.slice" / "memory.max", "1073741824\n")
    assert measure._cgroup_limit(proc, root) == 2**30


def test_unreadable_cgroup_means_no_limit(tmp_path):
    assert measure._cgroup_limit(tmp_path / "missing", tmp_path) is None


def test_cpu_limit_is_an_int_or_none():
    limit = memory_limit_bytes(CPU)
    assert limit is None or (isinstance(limit, int) and 0 < limit < 2**60)
    assert memory_limit_bytes(torch.device("meta")) is None


def test_peak_memory_sees_an_allocation_and_resets():
    reset_peak_memory(CPU)
    before = peak_memory_bytes(CPU)
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    peak = peak_memory_bytes(CPU)
    assert peak >= before and peak > 32 * 2**20
    del block


def test_peak_memory_falls_back_to_rss_without_vmhwm(monkeypatch):
    monkeypatch.setattr(measure, "_proc_status", lambda: {"VmRSS": 1234 * 1024})
    assert peak_memory_bytes(CPU) == 1234 * 1024
    monkeypatch.setattr(measure, "_proc_status", dict)
    assert peak_memory_bytes(CPU) >= 0  # getrusage's maximum resident set


def test_time_call_returns_the_median_and_runs_warmup_first():
    calls = []
    assert time_call(lambda: calls.append(1), CPU, repeats=3, warmup=2) >= 0.0
    assert len(calls) == 5
    with pytest.raises(ValueError, match="repeats=0"):
        time_call(lambda: None, CPU, repeats=0)
    with pytest.raises(ValueError, match="warmup=-1"):
        time_call(lambda: None, CPU, warmup=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_limit_and_peak():
    device = torch.device("cuda", 0)
    assert memory_limit_bytes(device) == torch.cuda.get_device_properties(device).total_memory
    reset_peak_memory(device)
    block = torch.ones(2**20, device=device)
    assert peak_memory_bytes(device) >= block.numel() * 4


def test_the_peak_of_a_limited_v1_cgroup_is_its_own_charge_and_resets(tmp_path, monkeypatch):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/lhtb-abc-n1\n")
    root = tmp_path / "fs"
    group = root / "memory" / "lhtb-abc-n1"
    _write(group / "memory.limit_in_bytes", str(2**30))
    _write(group / "memory.max_usage_in_bytes", str(700 * 2**20))
    monkeypatch.setattr(measure, "_PROC", tmp_path)
    monkeypatch.setattr(measure, "_CGROUP_ROOT", root)
    (tmp_path / "clear_refs").write_text("")
    assert measure._limited_cgroup_peak_file(proc, root) == group / "memory.max_usage_in_bytes"
    assert peak_memory_bytes(CPU) == 700 * 2**20  # the charge the kernel compares with the limit, not VmHWM
    reset_peak_memory(CPU)
    assert (group / "memory.max_usage_in_bytes").read_text() == "0"  # v1 restarts the peak at the current charge


def test_an_unlimited_cgroup_peak_is_not_used(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    root = tmp_path / "fs"
    _write(root / "job" / "memory.max", "max\n")
    _write(root / "job" / "memory.peak", "123\n")
    assert measure._limited_cgroup_peak_file(proc, root) is None  # no limit: the process's own high-water mark
    _write(root / "job" / "memory.max", str(2**30))
    assert measure._limited_cgroup_peak_file(proc, root) == root / "job" / "memory.peak"
