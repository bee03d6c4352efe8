"""Strategy-name registration in both the Trainer and Fabric registries."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDevice
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry

import lightning_hetero
from lightning_hetero.strategies import registry as registry_module
from lightning_hetero.strategies.registry import StrategySpec, register_builtin_strategies, register_strategy


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
