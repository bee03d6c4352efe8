"""Which checkpoint to resume from: the newest one that is complete and matches its checksums.

A save is *complete* once every rank has written its files; only then does rank 0 write a manifest next to it,
``<checkpoint>.manifest.json``, listing every file of the checkpoint with its size and SHA-256 (written to a
temporary name, fsynced and renamed, like the parts in :mod:`lightning_hetero.core.checkpoint_dir`). So:

- a crash during a save leaves a checkpoint without a manifest, which is never picked;
- a file truncated, corrupted or deleted afterwards no longer matches the manifest, and
  :func:`latest_good_checkpoint` falls back to the previous complete checkpoint, naming the bad file in a warning.

Framework-free: the Lightning callback that writes manifests is
:class:`lightning_hetero.callbacks.periodic_checkpoint.VerifiedCheckpoint`; any other writer can call
:func:`write_manifest` after its save finished on every rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_hetero.core.checkpoint_dir import CHECKSUM_SUFFIX, CorruptCheckpointError

__all__ = [
    "MANIFEST_SUFFIX",
    "CheckpointScan",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "checkpoint_bytes",
    "latest_good_checkpoint",
    "manifest_file",
    "remove_manifest",
    "scan_checkpoints",
    "verify_checkpoint",
    "write_manifest",
]

MANIFEST_SUFFIX = ".manifest.json"
FORMAT = "lightning-hetero-checkpoint-manifest"
VERSION = 1
_CHUNK = 1 << 20
log = logging.getLogger(__name__)


class IncompleteCheckpointError(ValueError):
    """A checkpoint has no manifest (its save did not finish) or lacks a file its manifest lists."""


def manifest_file(checkpoint: str | os.PathLike) -> Path:
    """The manifest of ``checkpoint`` (a file or a directory): ``<checkpoint>.manifest.json`` next to it."""
    path = Path(checkpoint)
    return path.with_name(path.name + MANIFEST_SUFFIX)


def _files(checkpoint: Path) -> Iterator[Path]:
    """Every file of a checkpoint (itself if it is a file), temporaries of an unfinished write left out."""
    if checkpoint.is_file():
        yield checkpoint
        return
    for path in sorted(checkpoint.rglob("*")):
        if path.is_file() and not path.name.endswith(".tmp"):
            yield path


def _sha256(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def write_manifest(checkpoint: str | os.PathLike, step: int, **extra: Any) -> Path:
    """Mark ``checkpoint`` complete: hash every file of it and write the manifest atomically (call on one rank,
    after every rank finished writing).

    Args:
        checkpoint: The checkpoint file or directory.
        step: The global step it holds (orders checkpoints; ties broken by the manifest's modification time).
        extra: More JSON-serializable fields to record (e.g. ``epoch``, ``save_seconds``).

    Raises:
        FileNotFoundError: ``checkpoint`` does not exist.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"Cannot write a manifest for {path}: it does not exist.")
    files = {}
    for file in _files(path):
        size, digest = _sha256(file)
        files[file.relative_to(path).as_posix() if path.is_dir() else "."] = {"bytes": size, "sha256": digest}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "checkpoint": path.name,
        "kind": "directory" if path.is_dir() else "file",
        "step": int(step),
        "files": files,
        **extra,
    }
    target = manifest_file(path)
    temporary = target.with_name(target.name + ".tmp")
    with open(temporary, "w") as stream:
        json.dump(manifest, stream, indent=1, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, target)
    _fsync_directory(target.parent)
    return target


def remove_manifest(checkpoint: str | os.PathLike) -> None:
    """Delete the manifest of ``checkpoint`` (first, before the checkpoint itself, so a half-deleted checkpoint is
    never taken for a complete one)."""
    manifest_file(checkpoint).unlink(missing_ok=True)


def _read_manifest(checkpoint: Path) -> dict[str, Any]:
    target = manifest_file(checkpoint)
    if not target.is_file():
        raise IncompleteCheckpointError(
            f"{checkpoint} has no manifest ({target.name}): its save did not finish on every rank, or another tool "
            "wrote it. It is not resumed from."
        )
    try:
        manifest = json.loads(target.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptCheckpointError(f"{target} is not a readable manifest ({error}).") from error
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CorruptCheckpointError(f"{target} is not a lightning-hetero checkpoint manifest.")
    return manifest


def verify_checkpoint(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """Check that ``checkpoint`` is complete and every file matches its manifest; returns the manifest.

    Directory checkpoints are also held to the ``<part>.pt.sha256`` sidecars of
    :mod:`lightning_hetero.core.checkpoint_dir` (a part must match its own sidecar too).

    Raises:
        IncompleteCheckpointError: no manifest, or a listed file is missing; the message names it.
        CorruptCheckpointError: a file's size or SHA-256 differs from the manifest (truncated, corrupted or
            replaced), or a part differs from its sidecar; the message names the file.
    """
    path = Path(checkpoint)
    manifest = _read_manifest(path)
    expected_kind = "directory" if path.is_dir() else "file"
    if path.exists() and manifest.get("kind") != expected_kind:
        raise CorruptCheckpointError(f"{path} is a {expected_kind}, but its manifest describes a {manifest['kind']}.")
    for name, entry in manifest["files"].items():
        file = path if name == "." else path / name
        if not file.is_file():
            raise IncompleteCheckpointError(f"{file} is missing: the checkpoint {path} is incomplete.")
        size, digest = _sha256(file)
        if (size, digest) != (entry.get("bytes"), entry.get("sha256")):
            raise CorruptCheckpointError(
                f"{file} does not match the checkpoint manifest ({size} bytes, sha256 {digest[:12]}...; expected "
                f"{entry.get('bytes')} bytes, sha256 {str(entry.get('sha256'))[:12]}...): the file is truncated or "
                "corrupted."
            )
        sidecar = file.with_name(file.name + CHECKSUM_SUFFIX)
        if sidecar.is_file() and sidecar.read_text().strip() != digest:
            raise CorruptCheckpointError(f"{file} does not match its checksum file {sidecar.name}.")
    return manifest


@dataclass
class CheckpointScan:
    """What :func:`scan_checkpoints` found: complete and verified checkpoints (newest first) and rejected ones."""

    good: list[Path] = field(default_factory=list)
    rejected: list[tuple[Path, str]] = field(default_factory=list)
    steps: dict[Path, int] = field(default_factory=dict)


def _candidates(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``: everything with a manifest, plus entries without one (reported as rejected)."""
    names = {p.name for p in directory.iterdir()}
    found = []
    for entry in directory.iterdir():
        if entry.name.endswith((MANIFEST_SUFFIX, ".tmp", CHECKSUM_SUFFIX)):
            if entry.name.endswith(MANIFEST_SUFFIX):
                found.append(entry.with_name(entry.name[: -len(MANIFEST_SUFFIX)]))
            continue
        if entry.name + MANIFEST_SUFFIX not in names and (entry.is_dir() or entry.suffix == ".ckpt"):
            found.append(entry)
    return found


def _order_key(checkpoint: Path) -> tuple[int, float]:
    """(step, manifest mtime) from the manifest; unreadable ones sort first so they are reported, then skipped."""
    try:
        manifest = json.loads(manifest_file(checkpoint).read_text())
        return int(manifest["step"]), manifest_file(checkpoint).stat().st_mtime
    except (OSError, ValueError, KeyError, TypeError):
        return (1 << 62), 0.0


def scan_checkpoints(directory: str | os.PathLike) -> CheckpointScan:
    """Verify every checkpoint in ``directory``: the good ones newest first (by step), and why the others failed."""
    root = Path(directory)
    scan = CheckpointScan()
    if not root.is_dir():
        return scan
    for checkpoint in sorted(_candidates(root), key=_order_key, reverse=True):
        try:
            manifest = verify_checkpoint(checkpoint)
        except (IncompleteCheckpointError, CorruptCheckpointError) as error:
            scan.rejected.append((checkpoint, str(error)))
            continue
        scan.good.append(checkpoint)
        scan.steps[checkpoint] = int(manifest["step"])
    return scan


def latest_good_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` whose files all match their checksums, or None.

    Newer checkpoints that are incomplete (a crash during the save) or corrupted are skipped with a warning naming
    the file, so a resume falls back to the previous good one. Every rank may call this: with no save in progress,
    all see the same files and pick the same checkpoint.
    """
    scan = scan_checkpoints(directory)
    newest_good = scan.steps.get(scan.good[0], -1) if scan.good else -1
    for checkpoint, reason in scan.rejected:
        if _order_key(checkpoint)[0] > newest_good:
            log.warning("Skipping checkpoint %s: %s", checkpoint, reason)
    return scan.good[0] if scan.good else None


def checkpoint_bytes(checkpoint: str | os.PathLike) -> int:
    """Total size of a checkpoint's files in bytes."""
    return sum(file.stat().st_size for file in _files(Path(checkpoint)))
