"""Rate, latency and layout parsing, the tbf burst/limit rule, and the environment refusals (no root needed)."""

from __future__ import annotations

import pytest

from lightning_hetero.testbed import checks
from lightning_hetero.testbed.checks import (
    TestbedConfigError,
    check_environment,
    parse_latency,
    parse_rate,
    validate_layout,
)
from lightning_hetero.testbed.shaping import TbfParameters, tbf_parameters


@pytest.mark.parametrize(
    ("text", "expected"),
    [("100mbit", 1e8), ("1.5gbit", 1.5e9), ("10mbps", 8e7), ("8kbit", 8e3), (2e6, 2e6), ("none", None), (None, None)],
)
def test_parse_rate(text, expected):
    assert parse_rate(text) == expected


@pytest.mark.parametrize(("text", "needle"), [("100mbits", "unknown unit 'mbits'"), ("fast", "Invalid bandwidth")])
def test_parse_rate_refuses_bad_strings_in_one_line(text, needle):
    with pytest.raises(TestbedConfigError, match=needle) as error:
        parse_rate(text)
    assert "\n" not in str(error.value) and "--bandwidth" in str(error.value)


def test_parse_rate_refuses_tiny_rates():
    with pytest.raises(TestbedConfigError, match="at least 8kbit"):
        parse_rate("7999bit")


@pytest.mark.parametrize(("text", "seconds"), [("20ms", 0.02), ("0.5s", 0.5), ("300us", 3e-4), ("1 msec", 1e-3)])
def test_parse_latency(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["20", "20m", "-1ms", "0ms", "abc"])
def test_parse_latency_refuses(text):
    with pytest.raises(TestbedConfigError, match="--latency"):
        parse_latency(text)


def test_tbf_parameters_small_rate_uses_the_floors():
    # 10mbit = 1.25 MB/s: 5 ms is 6250 B < 16 KiB floor; 50 ms is 62500 B < 64 KiB floor.
    assert tbf_parameters(1e7) == TbfParameters(10_000_000, 16384, 16384 + 65536)


def test_tbf_parameters_scale_with_rate():
    # 200mbit = 25 MB/s: burst 5 ms = 125000 B, queue 50 ms = 1250000 B.
    params = tbf_parameters(2e8)
    assert params == TbfParameters(200_000_000, 125_000, 125_000 + 1_250_000)
    assert params.tc_arguments() == ["rate", "200000000bit", "burst", "125000", "limit", "1375000"]
    assert params.burst_bytes >= 1514  # a full frame must always fit in the bucket


def test_validate_layout():
    validate_layout(2, 1, 29500)
    for nodes, ranks, port, needle in [(0, 1, 1, "--nodes"), (255, 1, 1, "--nodes"), (2, 0, 1, "--ranks-per-node")]:
        with pytest.raises(TestbedConfigError, match=needle):
            validate_layout(nodes, ranks, port)
    with pytest.raises(TestbedConfigError, match="--master-port"):
        validate_layout(2, 1, 70000)


def test_check_environment_refuses_non_root(monkeypatch):
    monkeypatch.setattr(checks.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedConfigError, match="needs root.*rerun as root"):
        check_environment()


@pytest.mark.parametrize("missing", ["ip", "tc"])
def test_check_environment_refuses_missing_tools(monkeypatch, missing):
    monkeypatch.setattr(checks.os, "geteuid", lambda: 0)
    monkeypatch.setattr(checks.shutil, "which", lambda tool: None if tool == missing else f"/sbin/{tool}")
    with pytest.raises(TestbedConfigError, match=f"'{missing}' was not found.*install iproute2"):
        check_environment()


def test_check_environment_refuses_latency_without_netem(monkeypatch):
    from lightning_hetero.testbed import netns

    monkeypatch.setattr(checks.os, "geteuid", lambda: 0)
    monkeypatch.setattr(checks.shutil, "which", lambda tool: f"/sbin/{tool}")
    monkeypatch.setattr(netns, "netem_available", lambda: False)
    with pytest.raises(TestbedConfigError, match="^netem is not available in this kernel; rerun without --latency.$"):
        check_environment(need_netem=True)
    check_environment(need_netem=False)  # netem is only probed when asked for
