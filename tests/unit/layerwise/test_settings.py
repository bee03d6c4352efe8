"""``LayerwiseSettings``: each field checked once, naming it; renamed 0.1 keywords fail naming the new key.

Also: the defaults are 0.1's, the settings are frozen, and a YAML ``init_args.settings`` reaches the strategy.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from lightning_hetero.core.settings import RenamedSettingError
from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
from lightning_hetero.layerwise.settings import LayerwiseSettings
from lightning_hetero.layerwise.stack import AUX_HEAD_KINDS
from lightning_hetero.pipeline.settings import PipelineSettings
from lightning_hetero.strategies.layerwise.fabric import LayerwiseStrategy as FabricLayerwiseStrategy
from lightning_hetero.strategies.layerwise.trainer import LayerwiseStrategy

ADAPTERS = [LayerwiseStrategy, FabricLayerwiseStrategy]


def _stages(count: int) -> PipelineSettings:
    return PipelineSettings(num_stages=count)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipeline": _stages(3), "boundaries": [1]}, r"LayerwiseSettings\.boundaries=\[1\] with .*num_stages - 1 = 2"),
        ({"pipeline": _stages(3), "boundaries": [2, 1]}, r"LayerwiseSettings\.boundaries=\[2, 1\]: use strictly"),
        ({"boundaries": [0]}, r"LayerwiseSettings\.boundaries=\[0\]: use ints >= 1"),
        ({"boundaries": ["1"]}, r"LayerwiseSettings\.boundaries=\['1'\]: use strictly increasing ints"),
        ({"boundaries": 1}, r"LayerwiseSettings\.boundaries=1: use a list of unit indices"),
        ({"aux_head": "conv"}, r"LayerwiseSettings\.aux_head='conv': use one of"),
        ({"aux_outputs": 0}, r"LayerwiseSettings\.aux_outputs=0: use an int >= 1"),
        ({"mode": "eventually"}, r"LayerwiseSettings\.mode='eventually': use one of"),
        ({"replay_capacity": 0}, r"LayerwiseSettings\.replay_capacity=0: use an int >= 1"),
        ({"replay_capacity": True}, r"LayerwiseSettings\.replay_capacity=True: use an int >= 1"),
        ({"max_in_flight": 0}, r"LayerwiseSettings\.max_in_flight=0: use an int >= 1"),
        ({"on_bad_payload": "ignore"}, r"LayerwiseSettings\.on_bad_payload='ignore': use one of"),
        ({"on_bad_payload": "drop"}, r"LayerwiseSettings\.on_bad_payload='drop' with .*mode='sync'.*use mode='async'"),
        ({"export_dir": ""}, r"LayerwiseSettings\.export_dir='': use a directory path"),
        ({"pipeline": {"num_stages": 2}}, r"LayerwiseSettings\.pipeline=\{'num_stages': 2\}: use PipelineSettings"),
    ],
)
def test_each_bad_value_names_its_field(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        LayerwiseSettings(**kwargs)


def test_defaults_are_those_of_0_1() -> None:
    settings = LayerwiseSettings()
    assert settings.pipeline == PipelineSettings(num_stages=2, data_parallel_size=1, boundary_dtype="fp32")
    assert (settings.boundaries, settings.aux_head, settings.aux_outputs, settings.mode) == (
        None,
        "linear",
        None,
        "sync",
    )
    assert (settings.replay_capacity, settings.max_in_flight, settings.on_bad_payload) == (4, 2, "raise")
    assert settings.export_dir is None
    # The Literal the CLI checks lists exactly the heads the stack builds.
    assert set(typing.get_args(typing.get_type_hints(LayerwiseSettings)["aux_head"])) == set(AUX_HEAD_KINDS)


def test_the_runtime_reads_every_field() -> None:
    settings = LayerwiseSettings(
        pipeline=PipelineSettings(num_stages=3, data_parallel_size=2, boundary_dtype="bf16"),
        boundaries=[1, 3],
        aux_head="mlp",
        aux_outputs=10,
        mode="async",
        replay_capacity=6,
        max_in_flight=3,
        on_bad_payload="drop",
    )
    assert settings.boundaries == (1, 3)  # a list becomes a tuple: the settings stay immutable
    runtime = DecoupledRuntime(settings)
    assert runtime.settings is settings
    assert (runtime.num_stages, runtime.data_parallel_size) == (3, 2)
    assert runtime.buffer.capacity == 6 and runtime.ring.capacity == 6
    assert runtime.meta()["activation_dtype"] == "bf16" and runtime.meta()["aux_head"] == "mlp"


def test_settings_are_frozen() -> None:
    settings = LayerwiseSettings(boundaries=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.mode = "async"  # type: ignore[misc]
    assert isinstance(settings.boundaries, tuple)


@pytest.mark.parametrize("cls", ADAPTERS)
@pytest.mark.parametrize("old", sorted(LayerwiseSettings.RENAMED))
def test_every_renamed_keyword_fails_naming_the_new_key(cls: type, old: str) -> None:
    new = LayerwiseSettings.RENAMED[old]
    with pytest.raises(RenamedSettingError, match=f"'{old}' -> '{new}'"):
        cls(**{old: 2})


def test_renamed_covers_every_0_1_keyword() -> None:
    old_keywords = {
        "num_stages", "boundaries", "data_parallel_size", "aux_head", "aux_outputs", "mode", "replay_capacity",
        "max_in_flight", "activation_dtype", "on_bad_payload", "export_dir",
    }  # fmt: skip
    assert set(LayerwiseSettings.RENAMED) == old_keywords
    fields = {f.name for f in dataclasses.fields(LayerwiseSettings)}
    pipeline_fields = {f.name for f in dataclasses.fields(PipelineSettings)}
    for target in LayerwiseSettings.RENAMED.values():
        parts = target.split(".")
        assert parts[0] == "settings" and parts[1] in fields
        if parts[1] == "pipeline":
            assert parts[2] in pipeline_fields


@pytest.mark.parametrize("cls", ADAPTERS)
def test_adapters_take_the_settings(cls: type) -> None:
    settings = LayerwiseSettings(mode="async", on_bad_payload="drop", export_dir="out")
    strategy = cls(settings=settings)
    assert strategy.settings is settings and strategy.runtime.settings is settings
    assert strategy.runtime.settings.on_bad_payload == "drop"
    assert cls.settings_class is LayerwiseSettings
    assert cls().settings == LayerwiseSettings()
    with pytest.raises(AttributeError):
        strategy.settings = LayerwiseSettings()  # type: ignore[misc]


def test_yaml_settings_reach_the_strategy(tmp_path, monkeypatch, capsys) -> None:
    from lightning_hetero.cli import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    config = tmp_path / "layerwise.yaml"
    config.write_text(
        "model:\n  class_path: lightning_hetero.models.CausalLMModule\n  init_args:\n    preset: llama-tiny\n"
        "trainer:\n  accelerator: cpu\n  devices: 3\n  logger: false\n"
        "  strategy:\n    class_path: LayerwiseStrategy\n    init_args:\n      settings:\n"
        "        pipeline: {num_stages: 3, boundary_dtype: int8}\n"
        "        boundaries: [1, 2]\n        mode: async\n        export_dir: out/dgl\n"
    )
    cli = build_cli(["--config", str(config), "--trainer.strategy.init_args.settings.replay_capacity", "7"], run=False)
    assert cli.trainer.strategy.settings == LayerwiseSettings(
        pipeline=PipelineSettings(num_stages=3, boundary_dtype="int8"),
        boundaries=(1, 2),
        mode="async",
        export_dir="out/dgl",
        replay_capacity=7,
    )
    # A bad value fails while the CLI parses, naming the field (nothing is launched) ...
    with pytest.raises(SystemExit):
        build_cli(["--config", str(config), "--trainer.strategy.init_args.settings.boundaries=[1]"], run=False)
    assert "LayerwiseSettings.boundaries=[1] with pipeline.num_stages=3" in capsys.readouterr().err
    # ... and so does a 0.1 key, naming where it went.
    with pytest.raises(SystemExit):
        build_cli(["--config", str(config), "--trainer.strategy.init_args.activation_dtype", "bf16"], run=False)
    assert "'activation_dtype' -> 'settings.pipeline.boundary_dtype'" in capsys.readouterr().err


@pytest.mark.parametrize("cls", ADAPTERS)
def test_the_base_builds_the_runtime_and_names_the_fix_for_an_unknown_keyword(cls: type) -> None:
    assert cls.settings_class is LayerwiseSettings and cls.runtime_class is DecoupledRuntime
    strategy = cls()
    assert isinstance(strategy.runtime, DecoupledRuntime) and strategy.runtime.owner == "LayerwiseStrategy"
    with pytest.raises(
        TypeError, match=r"LayerwiseStrategy: unexpected keyword argument 'bogus'.*settings=LayerwiseSettings\("
    ):
        cls(bogus=1)


def test_the_trainer_adapter_refuses_gradient_accumulation_naming_the_fix() -> None:
    from types import SimpleNamespace

    strategy = LayerwiseStrategy()
    with pytest.raises(ValueError, match=r"LayerwiseStrategy does not support accumulate_grad_batches=4: each stage"):
        strategy._check_trainer(SimpleNamespace(accumulate_grad_batches=4, lightning_module=None))
    strategy._check_trainer(SimpleNamespace(accumulate_grad_batches=1, lightning_module=None))
