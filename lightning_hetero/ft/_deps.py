"""torchft is an optional extra: import it only through :func:`require_torchft`, which names the install command."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["INSTALL_HINT", "require_torchft"]

INSTALL_HINT = "pip install 'lightning-hetero[ft]'  (installs torchft==0.2.0)"


def require_torchft() -> ModuleType:
    """Return the ``torchft`` module, or raise ImportError naming the extra to install."""
    try:
        return importlib.import_module("torchft")
    except ImportError as error:
        raise ImportError(
            f"The fault-tolerant (spot worker) mode needs torchft, which is not installed: {INSTALL_HINT}."
        ) from error
