"""One-screen messages for the ``lightning-hetero`` command's errors, each naming the fix.

jsonargparse reports a bad config as a nested union error (up to 50 lines after the usage) about one key at a time.
These functions read such a message (plus, for renamed keys, the YAML value it quotes and the command line) and
return what to tell the user instead, or None when they have nothing better to say:

- :func:`renamed_settings_message`: every key of a strategy's ``init_args`` renamed in 0.2, old -> new, in one go;
- :func:`unimportable_class_message`: a ``class_path`` whose module is not found, with the working-directory rule;
- :func:`raised_by`: whether an exception came from a given function (the strategies' launch check).
"""

from __future__ import annotations

import ast
import importlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

__all__ = ["raised_by", "renamed_keys", "renamed_settings_message", "unimportable_class_message"]

# jsonargparse's message for a key a class does not take, under the class it was given to.
_NOT_ACCEPTED = re.compile(
    r"class_path '(?P<path>[\w.]+)'(?:(?!class_path ').)*?"
    r"(?:Option '(?P<key>[\w.]+)' is not accepted|unrecognized arguments: --(?P<arg>[\w.]+))",
    re.S,
)
_GIVEN_DICT = re.compile(r"^\s*Given value: (\{.*\})\s*$", re.M)
_GIVEN_NESTED = re.compile(r"NestedArg\(key='(?P<key>[\w.]+)'")
_STRATEGY_FLAG = re.compile(r"^--trainer\.strategy\.(?:init_args\.)?(?P<key>[\w.]+?)(?:=.*)?$")
_MODULE_NOT_FOUND = re.compile(
    r"(?:Parser key \"(?P<key>[\w.]+)\"(?:(?!Parser key).)*?)?"
    r"class_path '(?P<path>[\w.]+)':\s*No module named '(?P<module>[\w.]+)'",
    re.S,
)


def renamed_keys(paths: Iterable[Sequence[str]], renamed: Mapping[str, str]) -> list[str]:
    """The old keys among ``paths`` (each a key path under ``init_args``, e.g. ``["settings", "compression"]``).

    A part listed in ``renamed`` is old unless the path up to it already is its new place (``settings.shard_size``).
    """
    old: list[str] = []
    for parts in paths:
        for index, part in enumerate(parts):
            if part in renamed and renamed[part] != ".".join(parts[: index + 1]):
                if part not in old:
                    old.append(part)
                break
    return old


def renamed_settings_message(message: str, argv: Sequence[str] = ()) -> str | None:
    """Every renamed key given to the strategy a jsonargparse error ``message`` is about, or None if there is none.

    Looks at the keys the message names, the ``init_args`` of the strategy value it quotes (a YAML) and the
    ``--trainer.strategy.init_args.<key>`` flags in ``argv``, so that one run reports them all. A strategy class with
    a ``settings_class`` declares its renamed keys in ``settings_class.RENAMED``; others are skipped.
    """
    for match in _NOT_ACCEPTED.finditer(message):
        cls = _import_class_path(match["path"])
        renamed = getattr(getattr(cls, "settings_class", None), "RENAMED", None)
        if cls is None or not isinstance(renamed, dict):
            continue
        paths = [(match["key"] or match["arg"]).split("."), *_given_paths(message)]
        paths += [flag["key"].split(".") for arg in argv if (flag := _STRATEGY_FLAG.match(arg))]
        old = renamed_keys(paths, renamed)
        if old:
            return _format_renamed(cls.__name__, old, renamed)
    return None


def _given_paths(message: str) -> list[list[str]]:
    """Key paths under ``init_args`` of the value a union error quotes (a YAML dict, or one nested flag)."""
    paths = [nested["key"].split(".") for nested in _GIVEN_NESTED.finditer(message)]
    for given in _GIVEN_DICT.finditer(message):
        try:
            value = ast.literal_eval(given[1])
        except (ValueError, SyntaxError):  # a value that is no Python literal: the message's own key stands
            continue
        init_args = value.get("init_args") if isinstance(value, dict) else None
        if isinstance(init_args, dict):
            paths += _key_paths(init_args)
    return paths


def _key_paths(mapping: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[list[str]]:
    paths: list[list[str]] = []
    for key, value in mapping.items():
        path = (*prefix, str(key))
        paths.append(list(path))
        if isinstance(value, dict) and path == ("settings",):  # one level into the settings object
            paths += _key_paths(value, path)
    return paths


def _format_renamed(owner: str, old: list[str], renamed: Mapping[str, str]) -> str:
    moves = "\n".join(f"  {key!r} -> {renamed[key]!r}" for key in old)
    return (
        f"{owner}: {len(old)} key(s) renamed in 0.2 (old -> new):\n{moves}\n"
        "Strategy settings live in one typed object: `init_args: {settings: {...}}` in YAML, settings=<the "
        "strategy's Settings>(...) in Python. See CHANGELOG.md (0.2, renamed keys)."
    )


def _import_class_path(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001  (an unimportable class_path: jsonargparse's own message stands)
        return None


def unimportable_class_message(message: str, cwd: str | None = None) -> str | None:
    """What to do about a ``class_path`` whose module is not found, or None when ``message`` is about something else.

    When the missing module is the class path's own (``mynets`` of ``mynets.LitLlama``) the fix is where the command
    runs; when it is something that module imports, the fix is to install it.
    """
    match = _MODULE_NOT_FOUND.search(message)
    if match is None:
        return None
    key = f"{match['key']}: " if match["key"] else ""
    path, missing = match["path"], match["module"]
    module = path.rpartition(".")[0]
    if module == missing or module.startswith(missing + "."):
        top = missing.partition(".")[0]
        return (
            f"{key}cannot import class_path {path!r}: no module named {missing!r} on the import path.\n"
            f"Your modules are imported from the working directory, {cwd or os.getcwd()}: run the command from "
            f"the folder that holds {top}.py (or the {top}/ package), put that folder on PYTHONPATH, or pip "
            "install your package."
        )
    return (
        f"{key}importing class_path {path!r} failed: {module!r} imports {missing!r}, which is not installed. "
        f"Install the package that provides {missing!r}, or fix that import."
    )


def raised_by(error: BaseException, function: str) -> bool:
    """Whether ``error`` was raised inside a function named ``function`` (anywhere down its traceback)."""
    traceback: TracebackType | None = error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_name == function:
            return True
        traceback = traceback.tb_next
    return False
