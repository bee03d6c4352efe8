"""Checkpoints, manifests and resume paths tried as an attacker (or a careless copy) would: nothing unpickles code,
nothing damaged loads silently, nothing silently restarts from step 0."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_hetero.core import checkpoint_dir
from lightning_hetero.core.checkpoint_dir import UnsafeLoadError, load_part, safe_load, write_part
from lightning_hetero.reliability import (
    CorruptCheckpointError,
    NoGoodCheckpointError,
    UnverifiedCheckpointWarning,
    corrupt_file,
    latest_good_checkpoint,
    manifest_file,
    scan_checkpoints,
    verify_checkpoint,
    verify_resume_checkpoint,
    write_manifest,
)


class _Exploit:
    """Unpickling this creates ``marker`` (a directory): what a crafted checkpoint does to an unsafe ``torch.load``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def _crafted(path: Path, marker: Path, **entries: Any) -> Path:
    torch.save({"state_dict": {}, "payload": _Exploit(marker), **entries}, path)
    return path


@pytest.fixture
def unsafe_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment variable that makes torch unpickle everything when ``weights_only`` is not passed."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


def _trainer_strategies() -> list[Any]:
    from lightning_hetero.strategies.matformer.trainer import MatFormerStrategy
    from lightning_hetero.strategies.sparseflip.trainer import SparseFlipStrategy

    return [SparseFlipStrategy(), MatFormerStrategy()]


def _fabric_strategies() -> list[Any]:
    from lightning_hetero.strategies.matformer.fabric import MatFormerStrategy
    from lightning_hetero.strategies.sparseflip.fabric import SparseFlipStrategy

    return [SparseFlipStrategy(), MatFormerStrategy()]


# ------------------------------------------------------------------------------------------- item 1: never unpickle
@pytest.mark.parametrize("weights_only", [None, False])
@pytest.mark.parametrize("index", [0, 1], ids=["sparseflip", "matformer"])
def test_trainer_strategy_never_runs_a_crafted_checkpoint(tmp_path, unsafe_env, index, weights_only):
    strategy = _trainer_strategies()[index]
    marker = tmp_path / "pwned"
    path = _crafted(tmp_path / "evil.ckpt", marker)
    with pytest.raises(pickle.UnpicklingError):
        strategy.load_checkpoint(path, weights_only=weights_only)
    assert not marker.exists()


@pytest.mark.parametrize("weights_only", [None, False])
@pytest.mark.parametrize("state", ["none", "dict", "optimizer"])
@pytest.mark.parametrize("index", [0, 1], ids=["sparseflip", "matformer"])
def test_fabric_strategy_never_runs_a_crafted_checkpoint(tmp_path, unsafe_env, index, state, weights_only):
    strategy = _fabric_strategies()[index]
    marker = tmp_path / "pwned"
    path = _crafted(tmp_path / "evil.ckpt", marker)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    requested = {"none": None, "dict": {"optimizer": optimizer}, "optimizer": optimizer}[state]
    with pytest.raises(pickle.UnpicklingError):
        strategy.load_checkpoint(path, requested, strict=False, weights_only=weights_only)
    assert not marker.exists()


def test_weights_only_false_is_refused_with_a_warning_but_plain_checkpoints_load(tmp_path):
    strategy = _trainer_strategies()[0]
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, path)
    with pytest.warns(UserWarning, match="weights_only=False is ignored"):
        checkpoint = strategy.load_checkpoint(path, weights_only=False)
    assert checkpoint["global_step"] == 3 and torch.equal(checkpoint["state_dict"]["w"], torch.ones(2))


def test_load_part_under_the_environment_variable_never_unpickles(tmp_path, unsafe_env):
    marker = tmp_path / "pwned"
    directory = tmp_path / "ckpt"
    write_part(directory, "rank_00000", {"w": torch.ones(1)})
    _crafted(directory / "rank_00000.pt", marker)
    (directory / "rank_00000.pt.sha256").unlink()  # an unchecked part: only the loader stands in the way
    with pytest.raises(pickle.UnpicklingError):
        load_part(directory, "rank_00000")
    assert not marker.exists()


def test_a_torch_that_would_unpickle_despite_weights_only_is_refused_before_loading(tmp_path, monkeypatch):
    """Simulate a torch build that honours TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD over an explicit ``weights_only=True``:
    the probe notices and nothing of the file is unpickled."""
    real_load = torch.load

    def overriding_load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = False
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", overriding_load)
    monkeypatch.setattr(checkpoint_dir, "_SAFE_LOAD_CHECKED", None)
    marker = tmp_path / "pwned"
    directory = tmp_path / "ckpt"
    write_part(directory, "rank_00000", {"w": torch.ones(1)})
    _crafted(directory / "rank_00000.pt", marker)
    (directory / "rank_00000.pt.sha256").unlink()
    with pytest.raises(UnsafeLoadError, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        load_part(directory, "rank_00000")
    with pytest.raises(UnsafeLoadError):
        _trainer_strategies()[0].load_checkpoint(directory / "rank_00000.pt")
    assert not marker.exists()


def test_safe_load_reads_plain_checkpoints(tmp_path, unsafe_env):
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(3), "meta": {"step": 2, "name": "x"}}, path)
    loaded = safe_load(path)
    assert torch.equal(loaded["w"], torch.arange(3)) and loaded["meta"] == {"step": 2, "name": "x"}


# ------------------------------------------------------------------------------------------- item 6: manifests
def _file_checkpoint(directory: Path, step: int) -> Path:
    path = directory / f"step={step:06d}.ckpt"
    torch.save({"state_dict": {"w": torch.full((8,), float(step))}, "global_step": step}, path)
    write_manifest(path, step=step)
    return path


def _edit_manifest(checkpoint: Path, **changes: Any) -> None:
    target = manifest_file(checkpoint)
    manifest = json.loads(target.read_text())
    for key, value in changes.items():
        if value is _DROP:
            manifest.pop(key)
        else:
            manifest[key] = value
    target.write_text(json.dumps(manifest))


_DROP = object()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"step": _DROP}, "step"),
        ({"step": "eight"}, "step"),
        ({"step": 8.5}, "step"),
        ({"step": True}, "step"),
        ({"step": -1}, "step"),
        ({"version": 2}, "version"),
        ({"version": _DROP}, "version"),
        ({"version": "1"}, "version"),
        ({"kind": "socket"}, "kind"),
        ({"files": {}}, "files"),
        ({"files": {".": {"bytes": "many", "sha256": "0" * 64}}}, "bytes"),
        ({"files": {".": {"bytes": 1, "sha256": "not hex"}}}, "sha256"),
        ({"files": {"other.ckpt": {"bytes": 1, "sha256": "0" * 64}}}, "lists files"),
    ],
)
def test_a_malformed_manifest_is_skipped_not_raised(tmp_path, changes, message):
    previous = _file_checkpoint(tmp_path, 4)
    newest = _file_checkpoint(tmp_path, 8)
    _edit_manifest(newest, **changes)
    with pytest.raises(CorruptCheckpointError, match=message):
        verify_checkpoint(newest)
    assert latest_good_checkpoint(tmp_path) == previous
    scan = scan_checkpoints(tmp_path)
    assert scan.good == [previous] and [p for p, _ in scan.rejected] == [newest]


@pytest.mark.parametrize("name", ["../outside.pt", "/etc/hostname", "."])
def test_a_manifest_naming_files_outside_its_directory_is_rejected(tmp_path, name):
    (tmp_path / "outside.pt").write_bytes(b"x")
    checkpoint = tmp_path / "step=000004.ckpt"
    write_part(checkpoint, "rank_00000", {"w": torch.ones(2)})
    write_manifest(checkpoint, step=4)
    target = manifest_file(checkpoint)
    manifest = json.loads(target.read_text())
    manifest["files"][name] = {"bytes": 1, "sha256": "0" * 64}
    target.write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match="outside"):
        verify_checkpoint(checkpoint)


def test_a_manifest_with_duplicate_keys_or_constants_is_rejected(tmp_path):
    checkpoint = _file_checkpoint(tmp_path, 4)
    target = manifest_file(checkpoint)
    text = target.read_text()
    target.write_text(text.replace('"step": 4', '"step": 4, "step": 9'))
    with pytest.raises(CorruptCheckpointError, match="duplicate"):
        verify_checkpoint(checkpoint)
    target.write_text(text.replace('"step": 4', '"step": NaN'))
    with pytest.raises(CorruptCheckpointError, match="NaN"):
        verify_checkpoint(checkpoint)


def test_a_directory_checkpoint_with_a_file_its_manifest_does_not_list_is_rejected(tmp_path):
    checkpoint = tmp_path / "step=000004.ckpt"
    write_part(checkpoint, "rank_00000", {"w": torch.ones(2)})
    write_manifest(checkpoint, step=4)
    write_part(checkpoint, "rank_00001", {"w": torch.ones(2)})  # added after the manifest: never verified
    with pytest.raises(CorruptCheckpointError, match="rank_00001.pt"):
        verify_checkpoint(checkpoint)


def test_every_manifest_gone_is_an_error_not_a_fresh_start(tmp_path):
    for step in (4, 8):
        manifest_file(_file_checkpoint(tmp_path, step)).unlink()
    with pytest.raises(NoGoodCheckpointError) as raised:
        latest_good_checkpoint(tmp_path)
    message = str(raised.value)
    assert str(tmp_path) in message and "step=000008.ckpt" in message and "allow_fresh_start=True" in message
    assert latest_good_checkpoint(tmp_path, allow_fresh_start=True) is None


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    corrupt_file(_file_checkpoint(tmp_path, 4))
    with pytest.raises(NoGoodCheckpointError, match="does not match"):
        latest_good_checkpoint(tmp_path)
    with pytest.warns(UserWarning, match="Starting fresh from step 0"):
        assert latest_good_checkpoint(tmp_path, allow_fresh_start=True) is None


def test_a_directory_without_checkpoints_is_a_fresh_start(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert latest_good_checkpoint(tmp_path) is None
    assert latest_good_checkpoint(tmp_path / "absent") is None


def test_a_given_ckpt_path_is_verified_when_it_has_a_manifest(tmp_path):
    checkpoint = _file_checkpoint(tmp_path, 4)
    assert verify_resume_checkpoint(checkpoint)["step"] == 4
    corrupt_file(checkpoint)
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        verify_resume_checkpoint(checkpoint)


def test_a_given_ckpt_path_without_a_manifest_loads_with_a_clear_warning(tmp_path):
    checkpoint = _file_checkpoint(tmp_path, 4)
    manifest_file(checkpoint).unlink()
    with pytest.warns(UnverifiedCheckpointWarning, match="no manifest"):
        assert verify_resume_checkpoint(checkpoint) is None


@pytest.mark.parametrize("index", [0, 1], ids=["sparseflip", "matformer"])
def test_trainer_strategy_refuses_a_flipped_bit_in_a_given_ckpt_path(tmp_path, index):
    strategy = _trainer_strategies()[index]
    checkpoint = _file_checkpoint(tmp_path, 4)
    corrupt_file(checkpoint)
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        strategy.load_checkpoint(checkpoint)


@pytest.mark.parametrize("index", [0, 1], ids=["sparseflip", "matformer"])
def test_fabric_strategy_refuses_a_flipped_bit_in_a_given_ckpt_path(tmp_path, index):
    strategy = _fabric_strategies()[index]
    checkpoint = _file_checkpoint(tmp_path, 4)
    corrupt_file(checkpoint)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        strategy.load_checkpoint(checkpoint, optimizer)


def test_strategy_warns_when_a_given_ckpt_path_has_no_manifest(tmp_path):
    strategy = _trainer_strategies()[0]
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}, "global_step": 1}, path)
    with pytest.warns(UnverifiedCheckpointWarning, match="no manifest"):
        strategy.load_checkpoint(path)


# ------------------------------------------------------------------------------------------- FlexDeMo metadata
_GOOD_META = {"format": "flexdemo-sharded", "version": 1, "world_size": 2, "shard_size": 1, "shapes": {"w": [4]}}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": 2}, "version"),
        ({"version": None}, "version"),
        ({"world_size": "2"}, "world_size"),
        ({"world_size": 2.0}, "world_size"),
        ({"shard_size": True}, "shard_size"),
        ({"world_size": 3, "shard_size": 2}, "world_size"),
        ({"shapes": [4]}, "shapes"),
        ({"shapes": {"w": [-4]}}, "shapes"),
        ({"shapes": {"w": "4"}}, "shapes"),
    ],
)
def test_flexdemo_metadata_with_impossible_fields_is_refused(tmp_path, changes, message):
    from lightning_hetero.flexdemo.checkpoint import read_meta

    write_part(tmp_path, "meta", {**_GOOD_META, **changes})
    with pytest.raises(ValueError, match=message):
        read_meta(tmp_path, None, "FlexDeMoStrategy")


def test_flexdemo_metadata_that_is_good_reads(tmp_path):
    from lightning_hetero.flexdemo.checkpoint import read_meta

    write_part(tmp_path, "meta", _GOOD_META)
    assert read_meta(tmp_path, None, "FlexDeMoStrategy") == _GOOD_META


def test_flexdemo_metadata_under_the_environment_variable_never_unpickles(tmp_path, unsafe_env):
    from lightning_hetero.flexdemo.checkpoint import read_meta

    marker = tmp_path / "pwned"
    _crafted(tmp_path / "meta.pt", marker, format="flexdemo-sharded")
    with pytest.raises(pickle.UnpicklingError):
        read_meta(tmp_path, None, "FlexDeMoStrategy")
    assert not marker.exists()
