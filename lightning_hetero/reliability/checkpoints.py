"""Which checkpoint to resume from: the newest one that is complete and matches its checksums.

A save is *complete* once every rank has written its files; only then does rank 0 write a manifest next to it,
``<checkpoint>.manifest.json``, listing every file of the checkpoint with its size and SHA-256 (written to a
temporary name, fsynced and renamed, like the parts in :mod:`lightning_hetero.core.checkpoint_dir`). So:

- a crash during a save leaves a checkpoint without a manifest, which is never picked;
- a file truncated, corrupted or deleted afterwards no longer matches the manifest, and
  :func:`latest_good_checkpoint` falls back to the previous complete checkpoint, naming the bad file in a warning;
- a manifest that is malformed (no integer ``step``, another ``version``, files outside the checkpoint) rejects its
  checkpoint the same way, never the whole search;
- a directory that holds checkpoints none of which verifies is an error (:class:`NoGoodCheckpointError`), not a
  silent start from step 0, unless the caller asks for a fresh start.

A checkpoint given by path (``ckpt_path``) is checked by :func:`verify_resume_checkpoint`: against its manifest when
it has one, with an :class:`UnverifiedCheckpointWarning` when it has none.

Manifests guard against accidents (crashes, truncation, bit flips, lost files), not against someone who can write
the checkpoint directory: they can write a matching manifest too. What keeps such a file from running code is that
every load is ``weights_only`` (:func:`lightning_hetero.core.checkpoint_dir.safe_load`).

Framework-free: the Lightning callback that writes manifests is
:class:`lightning_hetero.callbacks.periodic_checkpoint.VerifiedCheckpoint`; any other writer can call
:func:`write_manifest` after its save finished on every rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_hetero.core.checkpoint_dir import CHECKSUM_SUFFIX, CorruptCheckpointError

__all__ = [
    "MANIFEST_SUFFIX",
    "CheckpointScan",
    "IncompleteCheckpointError",
    "NoGoodCheckpointError",
    "UnverifiedCheckpointWarning",
    "checkpoint_bytes",
    "latest_good_checkpoint",
    "manifest_file",
    "remove_manifest",
    "scan_checkpoints",
    "verify_checkpoint",
    "verify_resume_checkpoint",
    "write_manifest",
]

MANIFEST_SUFFIX = ".manifest.json"
FORMAT = "lightning-hetero-checkpoint-manifest"
VERSION = 1
_CHUNK = 1 << 20
_MAX_STEP = (1 << 63) - 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
log = logging.getLogger(__name__)


class IncompleteCheckpointError(ValueError):
    """A checkpoint has no manifest (its save did not finish) or lacks a file its manifest lists."""


class NoGoodCheckpointError(RuntimeError):
    """A checkpoint directory holds checkpoints, but none is complete and intact: resuming would start over."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint is loaded without a manifest to check it against (a flipped bit would go unnoticed)."""


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
        manifest = json.loads(target.read_text(), object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CorruptCheckpointError(f"{target} is not a readable manifest ({error}).") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{target} is not a lightning-hetero checkpoint manifest.")
    _check_manifest(manifest, target)
    return manifest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})[:4]}")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_manifest(manifest: dict[str, Any], target: Path) -> None:
    """Raise :class:`CorruptCheckpointError` naming the field unless ``manifest`` has the layout of ``VERSION``."""
    version = manifest.get("version")
    if not _is_int(version) or version != VERSION:
        raise CorruptCheckpointError(
            f"{target} has manifest version {version!r}; this lightning-hetero reads version {VERSION} (written by "
            "another release?)."
        )
    step = manifest.get("step")
    if not _is_int(step) or not 0 <= step <= _MAX_STEP:
        raise CorruptCheckpointError(f"{target} has step {step!r}; expected an integer >= 0.")
    if manifest.get("kind") not in ("directory", "file"):
        raise CorruptCheckpointError(f"{target} has kind {manifest.get('kind')!r}; expected 'directory' or 'file'.")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CorruptCheckpointError(f"{target} lists no files; a manifest names every file of its checkpoint.")
    if manifest["kind"] == "file" and set(files) != {"."}:
        raise CorruptCheckpointError(f"{target} describes a file checkpoint but lists files {sorted(files)[:4]}.")
    for name, entry in files.items():
        parts = Path(name).parts
        if manifest["kind"] == "directory" and (not parts or Path(name).is_absolute() or ".." in parts):
            raise CorruptCheckpointError(f"{target} lists {name!r}, a path outside its checkpoint.")
        if not isinstance(entry, dict) or not _is_int(entry.get("bytes")) or entry["bytes"] < 0:
            raise CorruptCheckpointError(f"{target} has no valid byte count for {name!r} ({entry!r:.80}).")
        if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
            raise CorruptCheckpointError(f"{target} has no valid sha256 for {name!r}.")


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
    if path.is_dir():
        listed = {Path(name).as_posix() for name in manifest["files"]}
        unlisted = [f for f in _files(path) if f.relative_to(path).as_posix() not in listed]
        if unlisted:
            raise CorruptCheckpointError(
                f"{unlisted[0]} is not in the manifest of {path}: it was added or renamed after the save finished."
            )
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
        step = manifest["step"]
        if not _is_int(step):
            raise TypeError(step)
        return step, manifest_file(checkpoint).stat().st_mtime
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
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


def latest_good_checkpoint(directory: str | os.PathLike, allow_fresh_start: bool = False) -> Path | None:
    """The newest complete checkpoint in ``directory`` whose files all match their checksums.

    Newer checkpoints that are incomplete (a crash during the save), corrupted or with a malformed manifest are
    skipped with a warning naming the file, so a resume falls back to the previous good one. Every rank may call
    this: with no save in progress, all see the same files and pick the same checkpoint.

    Args:
        directory: The checkpoint directory (e.g. ``VerifiedCheckpoint``'s ``dirpath``).
        allow_fresh_start: When ``directory`` holds checkpoints but none verifies, warn and return None (start
            from step 0) instead of raising.

    Returns:
        The checkpoint to resume from; None when ``directory`` is missing or holds no checkpoint (a first start),
        or when none verifies and ``allow_fresh_start`` is True.

    Raises:
        NoGoodCheckpointError: ``directory`` holds checkpoints (``*.ckpt`` or manifests) but none is complete and
            intact; the message lists what was found and why each was rejected.
    """
    scan = scan_checkpoints(directory)
    if scan.good:
        newest_good = scan.steps[scan.good[0]]
        for checkpoint, reason in scan.rejected:
            if _order_key(checkpoint)[0] > newest_good:
                log.warning("Skipping checkpoint %s: %s", checkpoint, reason)
        return scan.good[0]
    found = [(p, r) for p, r in scan.rejected if p.suffix == ".ckpt" or manifest_file(p).exists()]
    if not found:
        return None
    listing = "; ".join(f"{path.name}: {reason.rstrip('.')}" for path, reason in found[:8])
    more = f" (and {len(found) - 8} more)" if len(found) > 8 else ""
    message = (
        f"{directory} holds {len(found)} checkpoint(s) but none is complete and intact, so there is nothing to resume "
        f"from: {listing}{more}."
    )
    if allow_fresh_start:
        warnings.warn(f"{message} Starting fresh from step 0 (allow_fresh_start=True).", UserWarning, stacklevel=2)
        return None
    raise NoGoodCheckpointError(
        f"{message} Restore the missing or damaged files (e.g. the *{MANIFEST_SUFFIX} manifests) from a copy, resume "
        "from a checkpoint you trust by its path, or pass allow_fresh_start=True (or empty the directory) to start "
        "over from step 0."
    )


def verify_resume_checkpoint(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """Check a checkpoint about to be resumed from by path: against its manifest when it has one (returns the
    manifest), with an :class:`UnverifiedCheckpointWarning` and None when it has none.

    Raises:
        IncompleteCheckpointError, CorruptCheckpointError: as :func:`verify_checkpoint`; the message names the file.
    """
    path = Path(checkpoint)
    if not manifest_file(path).exists():
        warnings.warn(
            f"{path} has no manifest ({manifest_file(path).name}), so it is loaded unverified: a truncated or "
            "corrupted file would go unnoticed. Checkpoints saved by lightning_hetero.callbacks.VerifiedCheckpoint "
            "(or marked with lightning_hetero.reliability.write_manifest) are checked before they load.",
            UnverifiedCheckpointWarning,
            stacklevel=2,
        )
        return None
    return verify_checkpoint(path)


def checkpoint_bytes(checkpoint: str | os.PathLike) -> int:
    """Total size of a checkpoint's files in bytes."""
    return sum(file.stat().st_size for file in _files(Path(checkpoint)))
