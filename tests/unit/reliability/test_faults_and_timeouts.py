"""Fault plans (parsing, which attempt fires) and the collective-timeout helpers."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed.distributed_c10d as c10d

from lightning_hetero.reliability import (
    FaultPlan,
    corrupt_file,
    explain_collective_error,
    group_default_timeout,
    inherit_group_timeout,
)


def test_parse_and_attempts(monkeypatch):
    plan = FaultPlan.parse("kill:rank=1:step=7")
    assert plan == FaultPlan("kill", 1, 7, 0)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert plan.applies("kill", 1, 7)
    assert not plan.applies("kill", 0, 7) and not plan.applies("kill", 1, 8) and not plan.applies("stop", 1, 7)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not plan.applies("kill", 1, 7)  # the restarted job runs clean
    assert FaultPlan.parse("stop:rank=0:step=3:attempt=any").applies("stop", 0, 3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("explode:rank=1:step=2", "Unknown fault kind"),
        ("kill:rank=1", "required"),
        ("kill:rank=1:step=2:when=now", "expected"),
        ("kill:rank=-1:step=2", "rank must be"),
    ],
)
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        FaultPlan.parse(spec)


def test_from_env(monkeypatch):
    monkeypatch.setenv("LIGHTNING_HETERO_FAULT", "")
    assert FaultPlan.from_env() is None
    monkeypatch.setenv("LIGHTNING_HETERO_FAULT", "save-kill:rank=2:step=8")
    assert FaultPlan.from_env() == FaultPlan("save-kill", 2, 8, 0)


def test_corrupt_file_flips_bytes(tmp_path):
    target = tmp_path / "blob"
    target.write_bytes(bytes(range(100)))
    offset = corrupt_file(target, count=4)
    data = target.read_bytes()
    assert offset == 50 and data[50:54] == bytes(255 - b for b in range(50, 54)) and data[:50] == bytes(range(50))


def test_inherit_group_timeout_sets_the_default_of_later_groups(monkeypatch):
    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)  # restored after the test
    if hasattr(c10d, "default_pg_nccl_timeout"):
        monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    inherit_group_timeout(None)
    assert group_default_timeout() == timedelta(minutes=30)
    inherit_group_timeout(timedelta(seconds=7))
    assert group_default_timeout() == timedelta(seconds=7)
    with pytest.raises(TypeError, match="timedelta"):
        inherit_group_timeout(7)  # type: ignore[arg-type]


def test_explain_collective_error():
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")
    assert "timed out (5 s" in explain_collective_error(timeout, timedelta(seconds=5))
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.213.0.2]:1234")
    assert "closed its connection" in explain_collective_error(closed)
    closed_by_timeout = RuntimeError("Application timeout caused pair closure")  # a stopped peer, seen by async ops
    assert "timed out (5 s" in explain_collective_error(closed_by_timeout, timedelta(seconds=5))
    assert explain_collective_error(ValueError("shapes differ")) is None
