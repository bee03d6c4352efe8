"""Strategy-name registration in both the Trainer and Fabric registries."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDevice
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry

import lightning_hetero
from lightning_hetero.strategies import registry as registry_module
from lightning_hetero.strategies.registry import (
    StrategySpec,
    register_builtin_strategies,
    register_strategy,
    spawn_alias,
    unknown_strategy_message,
)


class _TrainerProbe(SingleDeviceStrategy):
    pass


class _FabricProbe(FabricSingleDevice):
    pass


@pytest.fixture
def probe_name():
    name = "lightning_hetero_probe"
    yield name
    for registry in (StrategyRegistry, FABRIC_REGISTRY):
        dict.pop(registry, name, None)
        dict.pop(registry, f"{name}_spawn", None)


def test_register_in_both_registries_idempotently(probe_name):
    register_strategy(probe_name, _TrainerProbe, _FabricProbe, description="probe", device="cpu")
    register_strategy(probe_name, _TrainerProbe, _FabricProbe, description="probe", device="cpu")  # no error
    assert StrategyRegistry[probe_name]["strategy"] is _TrainerProbe
    assert FABRIC_REGISTRY[probe_name]["strategy"] is _FabricProbe
    assert isinstance(StrategyRegistry.get(probe_name), _TrainerProbe)
    assert isinstance(FABRIC_REGISTRY.get(probe_name), _FabricProbe)


def test_registered_name_resolves_in_trainer(probe_name):
    from lightning.pytorch import Trainer

    register_strategy(probe_name, _TrainerProbe, device="cpu")
    trainer = Trainer(strategy=probe_name.upper(), accelerator="cpu", devices=1, logger=False)  # flag lower-cased
    assert isinstance(trainer.strategy, _TrainerProbe)


def test_name_taken_by_another_class_is_refused(probe_name):
    register_strategy(probe_name, _TrainerProbe)
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(probe_name, SingleDeviceStrategy)


@pytest.mark.parametrize("bad", ["FlexDeMo", ""])
def test_name_must_be_lowercase(bad):
    with pytest.raises(ValueError, match="lowercase"):
        register_strategy(bad, _TrainerProbe)


def test_builtin_specs_register_and_reimport_is_idempotent(monkeypatch, probe_name):
    spec = StrategySpec(
        probe_name, f"{__name__}:_TrainerProbe", f"{__name__}:_FabricProbe", init_params={"device": "cpu"}
    )
    monkeypatch.setattr(registry_module, "BUILTIN_STRATEGIES", [spec])
    assert register_builtin_strategies() == [probe_name]
    assert register_builtin_strategies() == [probe_name]
    # Registered lazily: the class is imported when the name is used.
    assert StrategyRegistry[probe_name]["strategy"].resolve() is _TrainerProbe
    assert FABRIC_REGISTRY[probe_name]["strategy"].resolve() is _FabricProbe
    assert isinstance(StrategyRegistry.get(probe_name), _TrainerProbe)
    assert isinstance(FABRIC_REGISTRY.get(probe_name), _FabricProbe)
    register_strategy(probe_name, _TrainerProbe, _FabricProbe, device="cpu")  # the same classes, eagerly: accepted


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_package_import_loads_neither_lightning_nor_transformers():
    out = _run(
        "import sys, lightning_hetero, lightning_hetero.fabric\n"
        "print(sorted(m for m in ('lightning', 'transformers', 'torch') if m in sys.modules))"
    )
    assert out == "[]"


@pytest.mark.parametrize("lightning_first", [False, True])
def test_names_resolve_whichever_is_imported_first(lightning_first):
    """Registered by the post-import hook (lightning_hetero first) or at once (Lightning first); the name resolves
    to our class in both registries, and our strategy modules load only then."""
    first, second = (
        ("import lightning", "import lightning_hetero")
        if lightning_first
        else (
            "import lightning_hetero",
            "import lightning",
        )
    )
    out = _run(
        f"{first}\n{second}\nimport sys\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "loaded = 'lightning_hetero.strategies.flexdemo.trainer' in sys.modules\n"
        "trainer, fabric = StrategyRegistry.get('flexdemo'), STRATEGY_REGISTRY.get('matformer_spawn')\n"
        "print(loaded, type(trainer).__module__, type(fabric).__module__, fabric._start_method)"
    )
    assert out == (
        "False lightning_hetero.strategies.flexdemo.trainer lightning_hetero.strategies.matformer.fabric spawn"
    )


def test_package_import_is_idempotent():
    importlib.reload(lightning_hetero)
    importlib.reload(lightning_hetero)
    for spec in registry_module.BUILTIN_STRATEGIES:
        assert spec.name in StrategyRegistry or spec.name in FABRIC_REGISTRY


# ---------------------------------------------------------------------------------------------------- one table
def test_package_attributes_come_from_the_one_table():
    """``lightning_hetero.<Class>`` and ``lightning_hetero.fabric.<Class>`` are the classes of BUILTIN_STRATEGIES."""
    import lightning_hetero.fabric as fabric

    trainer_classes = {p.partition(":")[2]: p for s in registry_module.BUILTIN_STRATEGIES if (p := s.trainer_class)}
    fabric_classes = {p.partition(":")[2]: p for s in registry_module.BUILTIN_STRATEGIES if (p := s.fabric_class)}
    assert set(lightning_hetero.__all__) == {*trainer_classes, "__version__"}
    assert set(fabric.__all__) == set(fabric_classes)
    for name, path in trainer_classes.items():
        assert getattr(lightning_hetero, name) is registry_module.import_class(path)
        assert name in dir(lightning_hetero)
    for name, path in fabric_classes.items():
        assert getattr(fabric, name) is registry_module.import_class(path)
        assert name in dir(fabric)
    for name, module in registry_module.SETTINGS_CLASSES.items():
        assert (
            getattr(lightning_hetero, name) is getattr(fabric, name) is getattr(importlib.import_module(module), name)
        )
        assert name in dir(lightning_hetero) and name in dir(fabric)


def test_no_second_list_of_class_names():
    """The packages hold no TYPE_CHECKING import list (nor any other import of a strategy or settings class): every
    name comes from the table, so a new strategy cannot be half-registered."""
    import lightning_hetero.fabric as fabric

    for module in (lightning_hetero, fabric):
        tree = ast.parse(Path(module.__file__).read_text())
        blocks = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"]
        assert not blocks, f"{module.__name__} repeats the table in a TYPE_CHECKING block"
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not imported & {*registry_module.exported_names(fabric=module is fabric)}, module.__name__


def test_each_specs_settings_class_is_its_adapters():
    """The table's ``settings_class`` is the one the Trainer and Fabric adapters take (``settings_class``)."""
    for spec in registry_module.BUILTIN_STRATEGIES:
        settings = registry_module.import_class(spec.settings_class)
        for path in (spec.trainer_class, spec.fabric_class):
            assert registry_module.import_class(path).settings_class is settings, path


@dataclasses.dataclass(frozen=True)
class _ProbeSettings:
    RENAMED: ClassVar[dict[str, str]] = {}


def test_a_new_strategy_needs_one_entry(monkeypatch, probe_name):
    """One StrategySpec reaches every place a strategy is known: both registries (and its ``_spawn`` alias), the
    Trainer and Fabric package attributes, the settings attribute, the CLI's short class names and the typo check."""
    import lightning_hetero.fabric as fabric
    from lightning_hetero.cli.strategy_flags import class_form

    spec = StrategySpec(
        probe_name,
        f"{__name__}:_TrainerProbe",
        f"{__name__}:_FabricProbe",
        init_params={"device": "cpu"},
        settings_class=f"{__name__}:_ProbeSettings",
    )
    table = (*registry_module._STRATEGIES, spec)
    monkeypatch.setattr(registry_module, "BUILTIN_STRATEGIES", [e for s in table for e in (s, spawn_alias(s))])
    registered = register_builtin_strategies()
    assert {probe_name, f"{probe_name}_spawn"} <= set(registered)
    assert isinstance(StrategyRegistry.get(probe_name), _TrainerProbe)
    assert isinstance(FABRIC_REGISTRY.get(probe_name), _FabricProbe)
    assert dict.get(FABRIC_REGISTRY, f"{probe_name}_spawn")["strategy"].resolve() is _FabricProbe
    assert lightning_hetero._TrainerProbe is _TrainerProbe and "_TrainerProbe" in lightning_hetero.__dir__()
    assert fabric._FabricProbe is _FabricProbe and "_FabricProbe" in fabric.__dir__()
    assert lightning_hetero._ProbeSettings is fabric._ProbeSettings is _ProbeSettings
    assert _TrainerProbe in registry_module.import_cli_classes()  # the CLI's short class names
    assert _ProbeSettings in registry_module.import_cli_classes()
    assert class_form(probe_name, StrategyRegistry) == {
        "class_path": f"{__name__}._TrainerProbe",
        "init_args": {"device": "cpu"},
    }
    message = unknown_strategy_message(probe_name + "x", StrategyRegistry.available_strategies())
    assert f"Did you mean {probe_name!r}?" in message and f"layerwise, {probe_name} (each" in message


def test_a_spec_appended_to_the_table_is_a_package_attribute(monkeypatch, probe_name):
    import lightning_hetero.fabric as fabric

    spec = StrategySpec(probe_name, f"{__name__}:_TrainerProbe", f"{__name__}:_FabricProbe")
    monkeypatch.setattr(registry_module, "BUILTIN_STRATEGIES", [*registry_module.BUILTIN_STRATEGIES, spec])
    assert lightning_hetero._TrainerProbe is _TrainerProbe
    assert fabric._FabricProbe is _FabricProbe
    with pytest.raises(AttributeError, match="_FabricProbe"):
        lightning_hetero._FabricProbe  # noqa: B018  (a Fabric class is not a Trainer attribute)


def test_every_strategy_has_its_spawn_alias():
    specs = {spec.name: spec for spec in registry_module.BUILTIN_STRATEGIES}
    bases = [spec for name, spec in specs.items() if not name.endswith("_spawn")]
    assert len(specs) == 2 * len(bases)
    for base in bases:
        alias = specs[f"{base.name}_spawn"]
        assert (alias.trainer_class, alias.fabric_class) == (base.trainer_class, base.fabric_class)
        assert alias.init_params == {**base.init_params, "start_method": "spawn"}


def test_no_strategy_class_declares_an_unread_strategy_name():
    """Lightning reads ``strategy_name`` only on its own classes (their ``register_strategies``); ours register by
    the table, so the attribute would be a second, unchecked copy of the name."""
    for spec in registry_module.BUILTIN_STRATEGIES:
        for path in (spec.trainer_class, spec.fabric_class):
            cls = registry_module.import_class(path)
            assert "strategy_name" not in vars(cls), f"{path} sets strategy_name"
