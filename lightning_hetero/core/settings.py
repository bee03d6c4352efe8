"""What every strategy's typed settings share: renamed keys fail loudly, and field checks name the field and the fix.

Each strategy declares its settings once, as a frozen dataclass next to its algorithm (``flexdemo/settings.py``,
``matformer/settings.py``, ...). The runtime takes it; the Trainer and Fabric adapters take it as their ``settings``
argument, so LightningCLI reads and validates it from ``init_args.settings`` and documents each field once.

Settings renamed at 0.2 are listed in each class' ``RENAMED`` table (old key -> where it went). An old key, given
to an adapter in Python or in a YAML ``init_args``, raises :class:`RenamedSettingError` naming the replacement: we
are at 0.1, so there are no silent aliases.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass
from typing import Any

__all__ = [
    "RenamedSettingError",
    "check_choice",
    "check_fraction",
    "check_int",
    "check_nested",
    "check_positive",
    "reject_renamed",
    "setting_names",
]


class RenamedSettingError(TypeError):
    """A setting was given under a name it no longer has; the message names the new key."""


def reject_renamed(owner: str, given: Iterable[str], renamed: Mapping[str, str]) -> None:
    """Raise :class:`RenamedSettingError` if any key in ``given`` is an old name listed in ``renamed``.

    Args:
        owner: The class the keys were given to, e.g. ``"FlexDeMoStrategy"``.
        given: The keys the user passed (``**kwargs`` of an adapter, or the keys of a YAML ``init_args``).
        renamed: Old key -> its replacement, written as the user should write it (e.g. ``"settings.shard_size"``).
    """
    old = [key for key in given if key in renamed]
    if old:
        moves = "; ".join(f"{key!r} -> {renamed[key]!r}" for key in old)
        raise RenamedSettingError(
            f"{owner}: {', '.join(repr(k) for k in old)} renamed in 0.2 ({moves}). Strategy settings now live in one "
            "typed object: pass settings=<the strategy's Settings>(...) in Python, or `init_args: {settings: {...}}` "
            "in YAML. See CHANGELOG.md (0.2, renamed keys)."
        )


def setting_names(settings_class: type) -> frozenset[str]:
    """The field names of a settings dataclass."""
    if not is_dataclass(settings_class):
        raise TypeError(f"{settings_class!r} is not a dataclass.")
    return frozenset(field.name for field in fields(settings_class))


def _name(owner: str, field: str, value: Any) -> str:
    return f"{owner}.{field}={value!r}"


def check_int(owner: str, field: str, value: Any, *, minimum: int, allow_none: bool = False, fix: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) >= ``minimum`` (or None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{_name(owner, field, value)}: use an int >= {minimum}{'; ' + fix if fix else ''}.")


def check_positive(owner: str, field: str, value: Any, *, allow_zero: bool = False, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number > 0 (>= 0 with ``allow_zero``)."""
    if value is None and allow_none:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{_name(owner, field, value)}: use a finite number {bound}.")


def check_fraction(owner: str, field: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a number in (0, 1]."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
    if not ok:
        raise ValueError(f"{_name(owner, field, value)}: use a fraction in (0, 1], e.g. 1/32 = 0.03125.")


def check_nested(owner: str, field: str, value: Any, settings_class: type, keys: str, *, fix: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is a ``settings_class`` (a nested settings object; ``keys`` shows its
    main fields, e.g. ``"chunk=..., values=..."``), naming how to write it in Python and in YAML."""
    if not isinstance(value, settings_class):
        raise ValueError(
            f"{_name(owner, field, value)}: use {settings_class.__name__}({keys}) (in YAML: a mapping of those "
            f"keys){fix}."
        )


def check_choice(owner: str, field: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    options = list(choices)
    if value not in options:
        raise ValueError(f"{_name(owner, field, value)}: use one of {options}.")
