"""Files of a directory checkpoint (one part per writing rank plus metadata), written atomically and checksummed.

A part is written to a temporary name, flushed to disk and renamed, so a crash during a save never leaves a part
that loads as valid; its SHA-256 goes next to it (``<part>.pt.sha256``, written the same way, after the part), so a
truncated or corrupted part is detected on load with an error naming the file. Metadata formats belong to each
strategy; this module handles the part files.

Every checkpoint file lightning-hetero reads goes through :func:`safe_load`: ``torch.load(weights_only=True)``
(tensors and plain containers; a crafted pickle raises ``pickle.UnpicklingError`` and runs nothing), after checking
once per process that this torch really honours ``weights_only=True`` in the current environment (some releases
let ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` override it); where it does not, :class:`UnsafeLoadError` is raised before
any byte of the file is unpickled.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CorruptCheckpointError",
    "UnsafeLoadError",
    "load_part",
    "part_file",
    "remove_checkpoint",
    "require_safe_loading",
    "safe_load",
    "write_part",
]

CHECKSUM_SUFFIX = ".sha256"
_ENVIRONMENT = ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD")


class CorruptCheckpointError(ValueError):
    """A checkpoint part does not match the checksum written with it (truncated, corrupted or replaced)."""


class UnsafeLoadError(RuntimeError):
    """This torch would unpickle arbitrary objects even with ``weights_only=True``: no checkpoint is loaded."""


class _Probe:
    """Pickles as a call to :func:`_probe_called`, a global no weights-only unpickler allows."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_probe_called, ())


def _probe_called() -> str:
    return "unpickled"  # harmless: the probe only tells whether torch.load would have called it


_SAFE_LOAD_CHECKED: tuple[str | None, ...] | None = None
_SAFE_LOAD_LOCK = threading.Lock()


def require_safe_loading() -> None:
    """Raise :class:`UnsafeLoadError` unless ``torch.load(..., weights_only=True)`` refuses arbitrary globals here.

    Checked once per process and environment (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``/``TORCH_FORCE_WEIGHTS_ONLY_LOAD``)
    by loading a probe whose unpickling would call a function of this module; the probe itself does nothing.
    """
    global _SAFE_LOAD_CHECKED
    environment = tuple(os.environ.get(name) for name in _ENVIRONMENT)
    if _SAFE_LOAD_CHECKED == environment:
        return
    with _SAFE_LOAD_LOCK:
        buffer = io.BytesIO()
        torch.save(_Probe(), buffer)
        buffer.seek(0)
        try:
            torch.load(buffer, weights_only=True)
        except pickle.UnpicklingError:
            _SAFE_LOAD_CHECKED = environment
            return
        raise UnsafeLoadError(
            f"torch {torch.__version__} unpickled arbitrary objects although weights_only=True was passed "
            f"(environment: {dict(zip(_ENVIRONMENT, environment, strict=True))}); lightning-hetero never loads a "
            "checkpoint that way. Unset TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD, or use a torch that honours weights_only."
        )


def safe_load(source: str | os.PathLike | io.BytesIO, map_location: Any = "cpu") -> Any:
    """``torch.load`` restricted to tensors and plain containers, whatever the environment says.

    Raises:
        UnsafeLoadError: this torch would unpickle arbitrary objects here (see :func:`require_safe_loading`).
        pickle.UnpicklingError: the file holds anything else (e.g. a crafted pickle); nothing of it is executed.
    """
    require_safe_loading()
    return torch.load(source, map_location=map_location, weights_only=True)


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
        UnsafeLoadError: this torch would unpickle arbitrary objects here (see :func:`require_safe_loading`).
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
    return safe_load(io.BytesIO(payload), map_location=map_location)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint directory (or a single-file checkpoint) if it exists."""
    target = Path(path)
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
