"""Files of a directory checkpoint (one part per writing rank plus metadata), written atomically and checksummed.

A part is written to a temporary name, flushed to disk and renamed, so a crash during a save never leaves a part
that loads as valid; its SHA-256 goes next to it (``<part>.pt.sha256``, written the same way, after the part), so a
truncated or corrupted part is detected on load with an error naming the file. Metadata formats belong to each
strategy; this module handles the part files.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["CorruptCheckpointError", "load_part", "part_file", "remove_checkpoint", "write_part"]

CHECKSUM_SUFFIX = ".sha256"


class CorruptCheckpointError(ValueError):
    """A checkpoint part does not match the checksum written with it (truncated, corrupted or replaced)."""


def part_file(directory: str | os.PathLike, part: str) -> Path:
    """The file of ``part`` inside checkpoint ``directory``."""
    return Path(directory) / f"{part}.pt"


def write_part(directory: str | os.PathLike, part: str, state: Mapping[str, Any]) -> Path:
    """``torch.save`` ``state`` as ``part`` of ``directory`` (created): temporary file, fsync, rename; then its
    SHA-256 the same way."""
    target = part_file(directory, part)
    target.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    payload = buffer.getvalue()
    _write_atomically(target, payload)
    _write_atomically(_checksum_file(target), hashlib.sha256(payload).hexdigest().encode())
    return target


def _write_atomically(target: Path, payload: bytes) -> None:
    temporary = target.with_name(target.name + ".tmp")
    with open(temporary, "wb") as stream:
        stream.write(payload)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, target)


def _checksum_file(target: Path) -> Path:
    return target.with_name(target.name + CHECKSUM_SUFFIX)


def load_part(directory: str | os.PathLike, part: str, map_location: Any = "cpu") -> dict[str, Any]:
    """Load ``part`` of checkpoint ``directory`` with ``weights_only=True`` (tensors and plain containers only),
    after checking its SHA-256 when the checkpoint has one (parts written before checksums load unchecked).

    Raises:
        FileNotFoundError: the part is missing; the message names the file and the checkpoint.
        CorruptCheckpointError: the part does not match its checksum; the message names the file.
        pickle.UnpicklingError: the file holds anything else (e.g. a crafted pickle); nothing of it is executed.
    """
    target = part_file(directory, part)
    if not target.is_file():
        raise FileNotFoundError(f"{target} is missing: the checkpoint at {directory} has no part {part!r}.")
    payload = target.read_bytes()
    checksum = _checksum_file(target)
    if checksum.is_file():
        expected, actual = checksum.read_text().strip(), hashlib.sha256(payload).hexdigest()
        if actual != expected:
            raise CorruptCheckpointError(
                f"{target} does not match its checksum ({len(payload)} bytes, sha256 {actual[:12]}..., expected "
                f"{expected[:12]}...): the file is truncated or corrupted. Resume from an earlier checkpoint."
            )
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint directory (or a single-file checkpoint) if it exists."""
    target = Path(path)
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
