"""The CLI's argument handling and one-line refusals; nothing is created (the topology builder is booby-trapped)."""

from __future__ import annotations

import pytest

from lightning_hetero.testbed import __main__ as cli
from lightning_hetero.testbed import bed, checks


@pytest.fixture(autouse=True)
def _nothing_is_created(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a refusal must come before anything is created")

    monkeypatch.setattr(bed, "create_topology", forbidden)


def _refusal(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("python -m lightning_hetero.testbed: error: ")
    return err


def test_parse_arguments_splits_the_command():
    args, command = cli.parse_arguments(
        [
            "--nodes",
            "3",
            "--ranks-per-node",
            "2",
            "--bandwidth",
            "20mbit",
            "--report",
            "r.json",
            "--",
            "python",
            "-c",
            "x",
        ]
    )
    assert (args.nodes, args.ranks_per_node, args.bandwidth, args.report) == (3, 2, "20mbit", "r.json")
    assert (args.launch, args.master_port, args.timeout, args.latency) == ("per-rank", 29500, None, None)
    assert command == ["python", "-c", "x"]


def test_options_after_the_separator_belong_to_the_command():
    _, command = cli.parse_arguments(["--", "python", "--nodes", "--", "y"])
    assert command == ["python", "--nodes", "--", "y"]


def test_refuses_non_root(monkeypatch, capsys):
    monkeypatch.setattr(checks.os, "geteuid", lambda: 1000)
    assert "rerun as root" in _refusal(["--bandwidth", "100mbit", "--", "true"], capsys)


def test_refuses_missing_tc(monkeypatch, capsys):
    monkeypatch.setattr(checks.os, "geteuid", lambda: 0)
    monkeypatch.setattr(checks.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/ip")
    assert "'tc' was not found" in _refusal(["--", "true"], capsys)


def test_refuses_bad_rate_even_as_non_root(monkeypatch, capsys):
    monkeypatch.setattr(checks.os, "geteuid", lambda: 1000)
    assert "unknown unit 'mbits'" in _refusal(["--bandwidth", "100mbits", "--", "true"], capsys)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nodes", "2"], "no command given"),
        (["--selftest", "--", "true"], "--selftest takes no command"),
        (["--cleanup", "--selftest"], "not allowed with argument"),
        (["--launch", "per-host", "--", "true"], "invalid choice"),
        (["--timeout", "0", "--", "true"], "--timeout 0 must be positive"),
        (["--latency", "20", "--", "true"], "give a number with a unit"),
        (["--nodes", "0", "--", "true"], "--nodes 0 is out of range"),
        (["--frobnicate", "--", "true"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_refusals_are_one_line(argv, needle, capsys):
    assert needle in _refusal(argv, capsys)
