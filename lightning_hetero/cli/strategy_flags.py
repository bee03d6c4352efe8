"""``--trainer.strategy.init_args.settings.<key>=<v>`` on a strategy named by its registered name.

A YAML may name the strategy as ``strategy: flexdemo``: jsonargparse keeps that as a plain string, and a later
``--trainer.strategy.init_args...`` flag then has no class to apply to ("Expected a dot import path string"). The
documented overrides work for both ways of naming a strategy because the command first rewrites the name into its
class form (``{class_path: ..., init_args: <the name's bound arguments>}``), right before the first such flag.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["class_form", "first_strategy_override", "without_strategy_overrides"]

# A nested strategy flag; ``--trainer.strategy.help`` and ``.class_path`` are not overrides of init_args.
_OVERRIDE = re.compile(r"^--trainer\.strategy\.(?!help\b|class_path\b)[\w.]+(?:=.*)?$", re.S)
# Actions that print and exit: the parse that only reads the strategy's name must not run them.
_PRINTING = re.compile(r"^(?:-h|--help|--print_config(?:=.*)?)$", re.S)


def first_strategy_override(args: Sequence[str]) -> int | None:
    """The index of the first ``--trainer.strategy.<key>`` flag in ``args`` (None when there is none)."""
    return next((index for index, arg in enumerate(args) if _OVERRIDE.match(arg)), None)


def without_strategy_overrides(args: Sequence[str]) -> list[str]:
    """``args`` without the strategy overrides (with their values, when given as a separate argument) and without the
    flags that print and exit: what tells which strategy the overrides apply to."""
    kept: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
            continue
        if _OVERRIDE.match(arg):
            skip_value = "=" not in arg
            continue
        if not _PRINTING.match(arg):
            kept.append(arg)
    return kept


def class_form(name: str, registry: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``{class_path, init_args}`` of a registered strategy ``name`` (None when ``name`` is not registered).

    Args:
        name: The registered name (case-insensitive, as the Trainer lower-cases it).
        registry: The Trainer's ``StrategyRegistry`` (name -> ``{"strategy": class, "init_params": {...}}``).
    """
    entry = dict.get(registry, name.lower())  # the registry's own get() instantiates the strategy
    if entry is None:
        return None
    strategy = entry["strategy"]
    path = getattr(strategy, "path", None)  # a LazyStrategyClass: "package.module:Class"
    class_path = path.replace(":", ".") if path else f"{strategy.__module__}.{strategy.__qualname__}"
    init_args = dict(entry.get("init_params") or {})
    return {"class_path": class_path, "init_args": init_args} if init_args else {"class_path": class_path}
