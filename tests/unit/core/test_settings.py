"""core/settings.py: every check names ``<Owner>.<field>=<value>``; renamed keys raise naming the replacement."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass

import pytest

from lightning_hetero.core.settings import (
    RenamedSettingError,
    check_choice,
    check_fraction,
    check_int,
    check_positive,
    reject_renamed,
    setting_names,
)
from lightning_hetero.strategies.registry import SETTINGS_CLASSES


@pytest.mark.parametrize(
    ("check", "value", "kwargs"),
    [
        (check_int, 0, {"minimum": 1}),
        (check_int, 1.0, {"minimum": 1}),
        (check_int, True, {"minimum": 0}),
        (check_int, None, {"minimum": 0}),
        (check_int, "3", {"minimum": 0}),
        (check_positive, 0, {}),
        (check_positive, -1.0, {"allow_zero": True}),
        (check_positive, math.inf, {}),
        (check_positive, math.nan, {}),
        (check_positive, False, {}),
        (check_positive, None, {}),
        (check_fraction, 0, {}),
        (check_fraction, 1.01, {}),
        (check_fraction, True, {}),
        (check_fraction, None, {}),
        (check_fraction, "0.5", {}),
        (check_choice, "c", {"choices": ["a", "b"]}),
        (check_choice, None, {"choices": ["a", "b"]}),
    ],
)
def test_each_check_raises_naming_the_field(check, value, kwargs) -> None:
    with pytest.raises(ValueError, match=rf"^OwnerSettings\.the_field={value!r}: use "):
        check("OwnerSettings", "the_field", value, **kwargs)


@pytest.mark.parametrize(
    ("check", "value", "kwargs"),
    [
        (check_int, 1, {"minimum": 1}),
        (check_int, None, {"minimum": 1, "allow_none": True}),
        (check_positive, 0, {"allow_zero": True}),
        (check_positive, 2.5, {}),
        (check_positive, None, {"allow_none": True}),
        (check_fraction, 1, {}),
        (check_fraction, 1 / 32, {}),
        (check_fraction, None, {"allow_none": True}),
        (check_choice, "b", {"choices": ["a", "b"]}),
    ],
)
def test_valid_values_pass(check, value, kwargs) -> None:
    check("OwnerSettings", "the_field", value, **kwargs)


def test_check_int_appends_the_fix() -> None:
    with pytest.raises(ValueError, match=r"X\.every=-1: use an int >= 0; 0 turns it off\.$"):
        check_int("X", "every", -1, minimum=0, fix="0 turns it off")


def test_reject_renamed_names_every_old_key_and_its_replacement() -> None:
    renamed = {"compression": "settings.replication.kept_fraction", "shard_size": "settings.shard_size"}
    reject_renamed("S", ["settings", "timeout"], renamed)  # nothing renamed: no error
    with pytest.raises(RenamedSettingError) as caught:
        reject_renamed("FlexDeMoStrategy", ["shard_size", "timeout", "compression"], renamed)
    message = str(caught.value)
    assert message.startswith("FlexDeMoStrategy: 'shard_size', 'compression' renamed in 0.2")
    assert "'shard_size' -> 'settings.shard_size'" in message
    assert "'compression' -> 'settings.replication.kept_fraction'" in message
    assert isinstance(caught.value, TypeError)  # as an unexpected keyword argument would be


def test_setting_names() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Probe:
        a: int = 1
        b: str = "x"

    assert setting_names(Probe) == {"a", "b"}
    with pytest.raises(TypeError, match="is not a dataclass"):
        setting_names(int)


def test_settings_classes_are_lazy_package_attributes() -> None:
    """``from lightning_hetero import FlexDeMoSettings`` (and from ``.fabric``), without importing Lightning."""
    names = sorted(SETTINGS_CLASSES)
    code = (
        "import sys, dataclasses, lightning_hetero, lightning_hetero.fabric as fabric\n"
        f"for name in {names!r}:\n"
        "    cls = getattr(lightning_hetero, name)\n"
        "    assert getattr(fabric, name) is cls and cls.__name__ == name and dataclasses.is_dataclass(cls), name\n"
        "    assert name in dir(lightning_hetero) and name in dir(fabric), name\n"
        "print('lightning.pytorch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
