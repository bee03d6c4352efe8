"""Checkpoint discovery: the newest complete, checksum-clean checkpoint wins; damaged ones fall back to the previous."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from lightning_hetero.core.checkpoint_dir import load_part, write_part
from lightning_hetero.reliability import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NoGoodCheckpointError,
    corrupt_file,
    latest_good_checkpoint,
    manifest_file,
    remove_manifest,
    scan_checkpoints,
    verify_checkpoint,
    write_manifest,
)


def _file_checkpoint(directory: Path, step: int) -> Path:
    path = directory / f"step={step:06d}.ckpt"
    torch.save({"step": step, "weight": torch.full((64,), float(step))}, path)
    write_manifest(path, step=step)
    return path


def _directory_checkpoint(directory: Path, step: int, ranks: int = 2) -> Path:
    path = directory / f"step={step:06d}.ckpt"
    for rank in range(ranks):
        write_part(path, f"rank_{rank:05d}", {"weight": torch.full((64,), float(step + rank))})
    torch.save({"world_size": ranks}, path / "meta.pt")
    write_manifest(path, step=step)
    return path


def test_newest_complete_checkpoint_is_picked(tmp_path):
    _file_checkpoint(tmp_path, 4)
    newest = _file_checkpoint(tmp_path, 8)
    assert latest_good_checkpoint(tmp_path) == newest
    assert verify_checkpoint(newest)["step"] == 8


def test_empty_or_missing_directory_has_none(tmp_path):
    assert latest_good_checkpoint(tmp_path) is None
    assert latest_good_checkpoint(tmp_path / "absent") is None


@pytest.mark.parametrize("layout", [_file_checkpoint, _directory_checkpoint])
def test_corrupted_newest_falls_back_with_a_warning_naming_the_file(tmp_path, caplog, layout):
    previous = layout(tmp_path, 4)
    newest = layout(tmp_path, 8)
    damaged = newest if newest.is_file() else newest / "rank_00001.pt"
    corrupt_file(damaged)
    with pytest.raises(CorruptCheckpointError, match=str(damaged).replace("=", ".")):
        verify_checkpoint(newest)
    with caplog.at_level(logging.WARNING):
        assert latest_good_checkpoint(tmp_path) == previous
    assert str(damaged) in caplog.text


def test_truncated_part_is_rejected(tmp_path):
    previous = _directory_checkpoint(tmp_path, 4)
    newest = _directory_checkpoint(tmp_path, 8)
    part = newest / "rank_00000.pt"
    part.write_bytes(part.read_bytes()[:100])
    assert latest_good_checkpoint(tmp_path) == previous
    scan = scan_checkpoints(tmp_path)
    assert [p for p, _ in scan.rejected] == [newest]
    assert "rank_00000.pt" in scan.rejected[0][1]


def test_missing_part_or_manifest_means_incomplete(tmp_path):
    previous = _directory_checkpoint(tmp_path, 4)
    newest = _directory_checkpoint(tmp_path, 8)
    (newest / "rank_00001.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match="rank_00001.pt is missing"):
        verify_checkpoint(newest)
    assert latest_good_checkpoint(tmp_path) == previous
    remove_manifest(previous)
    with pytest.raises(IncompleteCheckpointError, match="no manifest"):
        verify_checkpoint(previous)
    with pytest.raises(NoGoodCheckpointError, match="none is complete"):  # never a silent start from step 0
        latest_good_checkpoint(tmp_path)
    with pytest.warns(UserWarning, match="Starting fresh"):
        assert latest_good_checkpoint(tmp_path, allow_fresh_start=True) is None


def test_unreadable_manifest_is_corrupt(tmp_path):
    previous = _file_checkpoint(tmp_path, 4)
    newest = _file_checkpoint(tmp_path, 8)
    manifest_file(newest).write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="manifest"):
        verify_checkpoint(newest)
    assert latest_good_checkpoint(tmp_path) == previous


def test_part_that_disagrees_with_its_own_sidecar_is_rejected(tmp_path):
    checkpoint = _directory_checkpoint(tmp_path, 4)
    sidecar = checkpoint / "rank_00000.pt.sha256"
    sidecar.write_text("0" * 64)
    write_manifest(checkpoint, step=4)  # a manifest over the inconsistent files
    with pytest.raises(CorruptCheckpointError, match="checksum file"):
        verify_checkpoint(checkpoint)


def test_manifest_records_every_file(tmp_path):
    checkpoint = _directory_checkpoint(tmp_path, 4, ranks=3)
    manifest = json.loads(manifest_file(checkpoint).read_text())
    assert manifest["kind"] == "directory" and manifest["step"] == 4
    assert sorted(manifest["files"]) == sorted(
        ["meta.pt", *(f"rank_{r:05d}.pt" for r in range(3)), *(f"rank_{r:05d}.pt.sha256" for r in range(3))]
    )


def _save_crashing_at(directory: Path, crash_at: int) -> int:
    """Save a 2-part checkpoint of step 8 into ``directory``; SIGKILL this process at the ``crash_at``-th fsync or
    rename (0: never). Returns how many there were."""
    calls = 0
    real_replace, real_fsync = os.replace, os.fsync

    def crash_point() -> None:
        nonlocal calls
        calls += 1
        if calls == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def replace(*args, **kwargs):
        crash_point()
        return real_replace(*args, **kwargs)

    def fsync(*args, **kwargs):
        crash_point()
        return real_fsync(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "replace", replace)
        patch.setattr(os, "fsync", fsync)
        path = directory / "step=000008.ckpt"
        for rank in range(2):
            write_part(path, f"rank_{rank:05d}", {"weight": torch.full((4096,), float(rank))})
        torch.save({"world_size": 2}, path / "meta.pt")
        write_manifest(path, step=8)
    return calls


def _killed_save(directory: Path, crash_at: int) -> bool:
    """Run the save in a forked child that SIGKILLs itself at ``crash_at``; True if it died by SIGKILL."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            _save_crashing_at(directory, crash_at)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_kill_at_any_point_of_a_save_leaves_nothing_that_loads_as_valid(tmp_path):
    """SIGKILL the writer at every fsync/rename of a 2-part save: the previous checkpoint stays the one resumed."""
    (tmp_path / "clean").mkdir()
    points = _save_crashing_at(tmp_path / "clean", crash_at=0)
    # 2 parts x (data + sidecar) x (fsync + rename) + the manifest's fsync, rename and directory fsync
    assert points == 11
    for crash_at in range(1, points + 1):
        directory = tmp_path / f"crash{crash_at}"
        directory.mkdir()
        previous = _directory_checkpoint(directory, 4)
        assert _killed_save(directory, crash_at), crash_at
        partial = directory / "step=000008.ckpt"
        if crash_at < points:  # the last point is the directory fsync after the manifest's rename: it is complete
            assert latest_good_checkpoint(directory) == previous, crash_at
            with pytest.raises((IncompleteCheckpointError, CorruptCheckpointError)):
                verify_checkpoint(partial)
        for part in partial.glob("rank_*.pt"):  # a part that exists is whole: it was renamed into place
            load_part(partial, part.stem)
