"""Activation cache for greedy layerwise training: the frozen prefix's output per sample, computed once.

Entries are keyed by ``(level, key)``: ``level`` ``j`` holds the input of block ``j`` (the output of block ``j - 1``),
``key`` names one sample (its dataset index, or a hash of its model inputs, see :func:`content_keys`). Values are
stored on the CPU, in memory or as one safetensors file per entry under ``directory``. ``max_bytes`` bounds what is
stored (both storages); past it :meth:`ActivationCache.put` refuses new entries and logs once, so the caller
recomputes those samples instead: slower, never different.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["CACHE_STORAGES", "ActivationCache", "content_keys"]

log = logging.getLogger(__name__)

CACHE_STORAGES: tuple[str, ...] = ("memory", "disk")


def content_keys(inputs: Mapping[str, Tensor]) -> list[str]:
    """One key per sample (row) of ``inputs``: a BLAKE2b hash of the row's bytes, dtypes and shapes, over all entries.

    Equal inputs give equal keys, so a cache keyed this way needs no sample index from the data loader.
    """
    rows = next(iter(inputs.values())).shape[0]
    hashers = [hashlib.blake2b(digest_size=16) for _ in range(rows)]
    for name in sorted(inputs):
        tensor = inputs[name].detach().to("cpu").contiguous()
        for row, hasher in enumerate(hashers):
            item = tensor[row]
            hasher.update(f"{name}:{item.dtype}:{tuple(item.shape)}".encode())
            hasher.update(item.numpy().tobytes() if item.dtype != torch.bfloat16 else item.view(torch.int16).numpy())
    return [hasher.hexdigest() for hasher in hashers]


class ActivationCache:
    """Per-sample activations of the frozen prefix, by level (see the module docstring).

    Args:
        storage: ``"memory"`` or ``"disk"``.
        max_bytes: Upper bound on stored bytes (None: unbounded). Entries past it are not stored (logged once).
        directory: Where ``"disk"`` storage writes (created; cleared by :meth:`clear`). Required for disk.
    """

    def __init__(self, storage: str = "memory", max_bytes: int | None = None, directory: str | Path | None = None):
        if storage not in CACHE_STORAGES:
            raise ValueError(f"cache storage={storage!r} is not one of {list(CACHE_STORAGES)}.")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"cache max_bytes={max_bytes!r} must be an integer >= 0 (or None for no limit).")
        if storage == "disk" and directory is None:
            raise ValueError("a disk activation cache needs a directory: pass cache_dir='path/to/cache'.")
        self.storage = storage
        self.max_bytes = max_bytes
        self.directory = Path(directory) if directory is not None else None
        self._memory: dict[int, dict[str, Tensor]] = {}
        self._sizes: dict[int, dict[str, int]] = {}
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.refused = 0
        self._warned = False

    # ------------------------------------------------------------------------------------------------ queries
    def __contains__(self, item: tuple[int, str]) -> bool:
        level, key = item
        return key in self._sizes.get(level, {})

    def has_all(self, level: int, keys: Sequence[str]) -> bool:
        """Whether every key is stored at ``level``."""
        stored = self._sizes.get(level, {})
        return all(key in stored for key in keys)

    def get_many(self, level: int, keys: Sequence[str]) -> Tensor:
        """The stored rows of ``keys`` at ``level``, stacked (``[len(keys), ...]``, CPU). All must be present."""
        if self.storage == "memory":
            rows = [self._memory[level][key] for key in keys]
        else:
            from safetensors.torch import load_file

            rows = [load_file(self._path(level, key))["h"] for key in keys]
        return torch.stack(rows)

    # ------------------------------------------------------------------------------------------------ updates
    def put_many(self, level: int, keys: Sequence[str], values: Tensor) -> int:
        """Store row ``i`` of ``values`` under ``keys[i]`` (already stored keys are skipped); returns rows stored."""
        stored = 0
        sizes = self._sizes.setdefault(level, {})
        cpu = values.detach().to("cpu")
        for key, row in zip(keys, cpu, strict=True):
            if key in sizes:
                continue
            size = row.numel() * row.element_size()
            if self.max_bytes is not None and self.bytes_used + size > self.max_bytes:
                self.refused += 1
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "activation cache full (%d bytes stored, max_bytes=%d): samples not cached from here on are "
                        "recomputed through the frozen blocks each time (slower, same values). Raise max_bytes to "
                        "cache more.",
                        self.bytes_used,
                        self.max_bytes,
                    )
                continue
            row = row.clone()  # a row of a batch would keep the whole batch's storage alive
            if self.storage == "memory":
                self._memory.setdefault(level, {})[key] = row
            else:
                from safetensors.torch import save_file

                path = self._path(level, key)
                path.parent.mkdir(parents=True, exist_ok=True)
                save_file({"h": row.contiguous()}, str(path))
            sizes[key] = size
            self.bytes_used += size
            stored += 1
        return stored

    def drop_levels_below(self, level: int) -> None:
        """Forget every level below ``level`` (their blocks are now frozen inside the prefix of a cached level)."""
        for old in [existing for existing in self._sizes if existing < level]:
            self.bytes_used -= sum(self._sizes.pop(old).values())
            self._memory.pop(old, None)
            if self.storage == "disk":
                shutil.rmtree(self._level_dir(old), ignore_errors=True)

    def clear(self) -> None:
        """Forget everything (and delete the disk levels)."""
        self.drop_levels_below(1 << 62)
        if self.storage == "disk" and self.directory is not None and self.directory.exists():
            for stale in self.directory.glob("level_*"):
                shutil.rmtree(stale, ignore_errors=True)

    def stats(self) -> dict[str, int]:
        """``bytes_used``, ``entries``, ``hits``, ``misses`` (batches served / not served), ``refused`` (rows)."""
        entries = sum(len(level) for level in self._sizes.values())
        return {
            "bytes_used": self.bytes_used,
            "entries": entries,
            "hits": self.hits,
            "misses": self.misses,
            "refused": self.refused,
        }

    def _level_dir(self, level: int) -> Path:
        assert self.directory is not None
        return self.directory / f"level_{level}"

    def _path(self, level: int, key: str) -> Path:
        return self._level_dir(level) / f"{key}.safetensors"
