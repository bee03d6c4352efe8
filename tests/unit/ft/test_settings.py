"""FaultToleranceSettings: defaults are valid, every bad field is named with its fix."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hetero.ft.settings import FaultToleranceSettings


def test_defaults_are_valid_and_frozen():
    settings = FaultToleranceSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.min_replicas = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("lighthouse", "localhost:29510", "use the lighthouse URL"),
        ("min_replicas", 0, "min_replicas=0: use an int >= 1"),
        ("min_replicas", True, "use an int"),
        ("timeout_s", 0, "timeout_s=0: use a finite number > 0"),
        ("quorum_timeout_s", float("inf"), "quorum_timeout_s"),
        ("replica_id_source", "slurm", "use one of ['env', 'hostname', 'fixed']"),
        ("max_recovery_bytes", -1, "max_recovery_bytes=-1"),
        ("max_retries", -1, "max_retries=-1: use an int >= 0"),
        ("max_retries", 1.5, "max_retries=1.5"),
    ],
)
def test_a_bad_field_is_named(field, value, words):
    with pytest.raises(ValueError, match="FaultToleranceSettings") as caught:
        FaultToleranceSettings(**{field: value})
    assert words in str(caught.value)


def test_max_retries_is_unbounded_by_default():
    assert FaultToleranceSettings().max_retries is None
    assert FaultToleranceSettings(max_retries=0).max_retries == 0


def test_fixed_replica_id_needs_an_id_and_env_source_needs_the_variable(monkeypatch):
    with pytest.raises(ValueError, match="non-empty id"):
        FaultToleranceSettings(replica_id_source="fixed")
    assert FaultToleranceSettings(replica_id_source="fixed", replica_id="node3").resolve_replica_id() == "node3"
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(ValueError, match=r"\$REPLICA_GROUP_ID is not set"):
        FaultToleranceSettings().resolve_replica_id()
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    assert FaultToleranceSettings().resolve_replica_id() == "2"


def test_lighthouse_address_falls_back_to_the_environment(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="torchft_lighthouse --min_replicas"):
        FaultToleranceSettings().lighthouse_address()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh:29510")
    assert FaultToleranceSettings().lighthouse_address() == "http://lh:29510"
    assert FaultToleranceSettings(lighthouse="http://a:1").lighthouse_address() == "http://a:1"


def test_without_torchft_the_error_names_the_extra(monkeypatch):
    import sys

    from lightning_hetero.ft import require_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)  # what an environment without the extra looks like to import
    with pytest.raises(ImportError, match=r"pip install 'lightning-hetero\[ft\]'"):
        require_torchft()
