"""Membership by a cluster secret: where it comes from, that it never shows, and what its tags bind."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle

import pytest

from lightning_hetero.ft.membership import MAC_BYTES, OPEN_KEY, ClusterSecret, SlotContext, load_secret
from lightning_hetero.ft.settings import FaultToleranceSettings

KEY = "k" * 40
CONTEXT = SlotContext("run-a", step=7, quorum=3, count=3, sequence=1)


def test_the_secret_comes_from_a_file_or_a_variable_and_never_shows(tmp_path, monkeypatch, caplog):
    path = tmp_path / "secret"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    from_file = load_secret(str(path), "UNSET_VARIABLE_33", required=True)
    monkeypatch.setenv("MY_FT_SECRET", KEY)
    from_env = load_secret("", "MY_FT_SECRET", required=True)
    payload = b"\x01\x02"
    assert from_file.slot_tag(CONTEXT, 0, payload) == from_env.slot_tag(CONTEXT, 0, payload)  # the same key
    for secret in (from_file, from_env):
        assert KEY not in repr(secret) and KEY not in str(secret) and "redacted" in repr(secret)
        with pytest.raises(TypeError, match="never pickled"):
            pickle.dumps(secret)
        assert copy.deepcopy(secret) is secret
    # The settings hold only where the secret is: a YAML dump / hparams of them never holds it.
    settings = FaultToleranceSettings(secret_file=str(path), secret_env="MY_FT_SECRET")
    assert KEY not in repr(settings) and KEY not in str(dataclasses.asdict(settings))
    assert KEY not in caplog.text


def test_a_missing_short_or_required_secret_is_refused_naming_the_fix(tmp_path, monkeypatch, caplog):
    with pytest.raises(ValueError, match="secret_file='/nonexistent/s' cannot be read"):
        load_secret("/nonexistent/s", "", required=False)
    monkeypatch.setenv("SHORT_SECRET_33", "abc")
    with pytest.raises(ValueError, match="at least 16 random bytes"):
        load_secret("", "SHORT_SECRET_33", required=False)
    monkeypatch.delenv("UNSET_VARIABLE_33", raising=False)
    with pytest.raises(ValueError, match=r"require_secret=True.*export \$UNSET_VARIABLE_33"):
        load_secret("", "UNSET_VARIABLE_33", required=True)
    with caplog.at_level(logging.WARNING, "lightning_hetero.ft"):
        secret = load_secret("", "UNSET_VARIABLE_33", required=False)
    assert secret.open and "membership is OPEN" in caplog.text
    readable = tmp_path / "readable"
    readable.write_text(KEY)
    readable.chmod(0o644)
    with caplog.at_level(logging.WARNING, "lightning_hetero.ft"):
        load_secret(str(readable), "", required=True)
    assert "chmod 600" in caplog.text


def test_settings_validate_the_new_fields():
    with pytest.raises(ValueError, match="outlier_factor=1"):
        FaultToleranceSettings(outlier_factor=1)
    with pytest.raises(ValueError, match="require_secret='yes'"):
        FaultToleranceSettings(require_secret="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="recovery_bind=3"):
        FaultToleranceSettings(recovery_bind=3)  # type: ignore[arg-type]
    assert FaultToleranceSettings(outlier_factor=0).outlier_factor == 0


def test_a_slot_tag_binds_every_field_and_every_bit():
    secret = ClusterSecret(KEY.encode(), "test")
    payload = bytes(range(64))
    tag = secret.slot_tag(CONTEXT, 2, payload)
    assert len(tag) == MAC_BYTES and secret.slot_ok(CONTEXT, 2, payload, tag)
    for changed in (
        dataclasses.replace(CONTEXT, step=6),  # a replay of the step before
        dataclasses.replace(CONTEXT, quorum=2),  # of another quorum
        dataclasses.replace(CONTEXT, sequence=0),  # of another collective of the step
        dataclasses.replace(CONTEXT, count=2),
        dataclasses.replace(CONTEXT, cluster="run-b"),  # of another run sharing the secret
    ):
        assert not secret.slot_ok(changed, 2, payload, tag), changed
    assert not secret.slot_ok(CONTEXT, 1, payload, tag)  # copied into another slot
    for byte in range(len(payload)):
        for bit in range(8):
            flipped = bytearray(payload)
            flipped[byte] ^= 1 << bit
            assert not secret.slot_ok(CONTEXT, 2, bytes(flipped), tag)
    assert not ClusterSecret(b"x" * 40, "other").slot_ok(CONTEXT, 2, payload, tag)  # a stranger's key
    assert not ClusterSecret(OPEN_KEY, "open").slot_ok(CONTEXT, 2, payload, tag)


def test_request_and_blob_tags_are_bound_to_step_nonce_and_quorum():
    secret, other = ClusterSecret(KEY.encode(), "a"), ClusterSecret(b"y" * 32, "b")
    token = secret.request_token("c", 5, "n1")
    assert secret.request_ok("c", 5, "n1", token)
    assert not secret.request_ok("c", 6, "n1", token) and not secret.request_ok("c", 5, "n2", token)
    assert not other.request_ok("c", 5, "n1", token)
    tagger = secret.blob_tagger("c", 5, b"blob")
    tag = ClusterSecret.finish_blob_tag(tagger, "n1")
    assert tag == ClusterSecret.finish_blob_tag(secret.blob_tagger("c", 5, b"blob"), "n1")  # copy leaves it intact
    assert ClusterSecret.finish_blob_tag(tagger, "n2") != tag
    for changed in (
        secret.blob_tagger("c", 6, b"blob"),
        secret.blob_tagger("d", 5, b"blob"),
        secret.blob_tagger("c", 5, b"blob!"),
    ):
        assert ClusterSecret.finish_blob_tag(changed, "n1") != tag
