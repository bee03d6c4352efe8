"""Files of a directory checkpoint (one part per writing rank plus metadata), written atomically.

A part is written to a temporary name, flushed to disk and renamed, so a crash during a save never leaves a part
that loads as valid. Metadata formats belong to each strategy; this module handles the part files.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_part", "part_file", "remove_checkpoint", "write_part"]


def part_file(directory: str | os.PathLike, part: str) -> Path:
    """The file of ``part`` inside checkpoint ``directory``."""
    return Path(directory) / f"{part}.pt"


def write_part(directory: str | os.PathLike, part: str, state: Mapping[str, Any]) -> Path:
    """``torch.save`` ``state`` as ``part`` of ``directory`` (created): temporary file, fsync, rename."""
    target = part_file(directory, part)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    with open(temporary, "wb") as stream:
        torch.save(dict(state), stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, target)
    return target


def load_part(directory: str | os.PathLike, part: str, map_location: Any = "cpu") -> dict[str, Any]:
    """Load ``part`` of checkpoint ``directory`` with ``weights_only=True`` (tensors and plain containers only).

    Raises:
        FileNotFoundError: the part is missing; the message names the file and the checkpoint.
        pickle.UnpicklingError: the file holds anything else (e.g. a crafted pickle); nothing of it is executed.
    """
    target = part_file(directory, part)
    if not target.is_file():
        raise FileNotFoundError(f"{target} is missing: the checkpoint at {directory} has no part {part!r}.")
    return torch.load(target, map_location=map_location, weights_only=True)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint directory (or a single-file checkpoint) if it exists."""
    target = Path(path)
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
