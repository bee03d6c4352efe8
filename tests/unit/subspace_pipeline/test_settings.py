"""``SubspacePipelineSettings``: each field checked once, naming it; renamed 0.1 keywords fail naming the new key.

Also: the defaults are 0.1's, the settings are frozen, and a YAML ``init_args.settings`` reaches the strategy.
"""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hetero.core.settings import RenamedSettingError
from lightning_hetero.pipeline.settings import PipelineSettings
from lightning_hetero.strategies.subspace_pipeline.fabric import (
    SubspacePipelineStrategy as FabricSubspacePipelineStrategy,
)
from lightning_hetero.strategies.subspace_pipeline.trainer import SubspacePipelineStrategy
from lightning_hetero.subspace_pipeline.runtime import SubspacePipelineRuntime
from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings

ADAPTERS = [SubspacePipelineStrategy, FabricSubspacePipelineStrategy]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "zigzag"}, r"SubspacePipelineSettings\.schedule='zigzag' is not a known schedule"),
        ({"schedule": "interleaved"}, r"SubspacePipelineSettings\.schedule='interleaved': interleaved schedules"),
        ({"n_microbatches": 0}, r"SubspacePipelineSettings\.n_microbatches=0: use an int >= 1"),
        ({"n_microbatches": 2.0}, r"SubspacePipelineSettings\.n_microbatches=2\.0: use an int >= 1"),
        ({"compress": "yes"}, r"SubspacePipelineSettings\.compress='yes': use true or false"),
        ({"subspace_dim": 0}, r"SubspacePipelineSettings\.subspace_dim=0: use an int >= 1"),
        ({"subspace_dim": True}, r"SubspacePipelineSettings\.subspace_dim=True: use an int >= 1"),
        ({"dim_ratio": 0.5}, r"SubspacePipelineSettings\.dim_ratio=0\.5: use a number >= 1 \(it is d / k\)"),
        ({"dim_ratio": float("nan")}, r"SubspacePipelineSettings\.dim_ratio=nan: use a finite number"),
        ({"subspace_dim": 8, "dim_ratio": 4.0}, r"SubspacePipelineSettings\.subspace_dim=8 and .*dim_ratio=4\.0"),
        ({"mode": "sideways"}, r"SubspacePipelineSettings\.mode='sideways': use one of"),
        ({"update_every": -1}, r"SubspacePipelineSettings\.update_every=-1: use an int >= 0"),
        ({"update_every": 5, "compress": False}, r"SubspacePipelineSettings\.update_every=5 with .*compress=False"),
        ({"update_lr": 0.0}, r"SubspacePipelineSettings\.update_lr=0\.0: use a finite number > 0"),
        ({"seed": 1.5}, r"SubspacePipelineSettings\.seed=1\.5: use an int"),
        ({"on_bad_payload": "drop"}, r"SubspacePipelineSettings\.on_bad_payload='drop': .*cannot be dropped"),
        ({"on_bad_payload": "ignore"}, r"SubspacePipelineSettings\.on_bad_payload='ignore': use one of \['raise'\]"),
        ({"pipeline": {"num_stages": 2}}, r"SubspacePipelineSettings\.pipeline=\{'num_stages': 2\}: use Pipeline"),
    ],
)
def test_each_bad_value_names_its_field(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        SubspacePipelineSettings(**kwargs)


def test_defaults_are_those_of_0_1() -> None:
    settings = SubspacePipelineSettings()
    assert settings.pipeline == PipelineSettings(num_stages=2, data_parallel_size=1, boundary_dtype="fp32")
    assert (settings.schedule, settings.n_microbatches, settings.compress, settings.mode) == (
        "1f1b",
        None,
        True,
        "reparam",
    )
    assert (settings.update_every, settings.update_lr, settings.seed, settings.on_bad_payload) == (0, 0.1, 0, "raise")
    assert settings.num_microbatches == 2  # n_microbatches=None: one per stage
    runtime = SubspacePipelineRuntime(settings)
    assert runtime.config.dim_ratio == 16.0 and runtime.config.subspace_dim is None  # d/k = 16 when no size is given
    assert runtime.num_stages == 2 and runtime.data_parallel_size == 1
    plain = SubspacePipelineRuntime(SubspacePipelineSettings(compress=False))
    assert plain.config.dim_ratio is None and not plain.config.compress


def test_the_runtime_reads_every_field() -> None:
    settings = SubspacePipelineSettings(
        pipeline=PipelineSettings(num_stages=3, data_parallel_size=2, boundary_dtype="int8"),
        schedule="GPipe",
        n_microbatches=6,
        subspace_dim=8,
        mode="projected",
        update_every=4,
        update_lr=0.25,
        seed=7,
    )
    assert settings.schedule == "gpipe"  # the canonical spelling
    runtime = SubspacePipelineRuntime(settings)
    assert runtime.settings is settings
    assert (runtime.num_stages, runtime.data_parallel_size) == (3, 2)
    config = runtime.config
    assert (config.subspace_dim, config.dim_ratio, config.coord_dtype, config.mode) == (8, None, "int8", "projected")
    assert (config.update_every, config.update_lr, config.seed) == (4, 0.25, 7)
    assert SubspacePipelineRuntime(SubspacePipelineSettings(dim_ratio=32)).config.dim_ratio == 32


def test_settings_are_frozen() -> None:
    settings = SubspacePipelineSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.subspace_dim = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.pipeline.num_stages = 4  # type: ignore[misc]


@pytest.mark.parametrize("cls", ADAPTERS)
@pytest.mark.parametrize("old", sorted(SubspacePipelineSettings.RENAMED))
def test_every_renamed_keyword_fails_naming_the_new_key(cls: type, old: str) -> None:
    new = SubspacePipelineSettings.RENAMED[old]
    with pytest.raises(RenamedSettingError, match=f"'{old}' -> '{new}'"):
        cls(**{old: 2})


def test_renamed_covers_every_0_1_keyword() -> None:
    old_keywords = {
        "num_stages", "rank", "compression", "schedule", "n_microbatches", "data_parallel_size", "compress", "mode",
        "coord_dtype", "update_every", "update_lr", "seed", "on_bad_payload",
    }  # fmt: skip
    assert set(SubspacePipelineSettings.RENAMED) == old_keywords
    fields = {f.name for f in dataclasses.fields(SubspacePipelineSettings)}
    pipeline_fields = {f.name for f in dataclasses.fields(PipelineSettings)}
    for target in SubspacePipelineSettings.RENAMED.values():  # every target exists
        parts = target.split(".")
        assert parts[0] == "settings"
        assert parts[1] in fields
        if parts[1] == "pipeline":
            assert parts[2] in pipeline_fields


@pytest.mark.parametrize("cls", ADAPTERS)
def test_adapters_take_the_settings(cls: type) -> None:
    settings = SubspacePipelineSettings(subspace_dim=8, n_microbatches=4)
    strategy = cls(settings=settings)
    assert strategy.settings is settings and strategy.runtime.settings is settings
    assert cls.settings_class is SubspacePipelineSettings
    assert cls().settings == SubspacePipelineSettings()
    with pytest.raises(AttributeError):
        strategy.settings = SubspacePipelineSettings()  # type: ignore[misc]


def test_yaml_settings_reach_the_strategy(tmp_path, monkeypatch, capsys) -> None:
    from lightning_hetero.cli import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    config = tmp_path / "subspace.yaml"
    config.write_text(
        "model:\n  class_path: lightning_hetero.models.CausalLMModule\n  init_args:\n    preset: llama-tiny\n"
        "trainer:\n  accelerator: cpu\n  devices: 4\n  logger: false\n"
        "  strategy:\n    class_path: SubspacePipelineStrategy\n    init_args:\n      settings:\n"
        "        pipeline: {num_stages: 2, data_parallel_size: 2, boundary_dtype: bf16}\n"
        "        subspace_dim: 8\n        schedule: gpipe\n        update_every: 3\n"
    )
    cli = build_cli(["--config", str(config), "--trainer.strategy.init_args.settings.seed", "5"], run=False)
    settings = cli.trainer.strategy.settings
    assert settings == SubspacePipelineSettings(
        pipeline=PipelineSettings(num_stages=2, data_parallel_size=2, boundary_dtype="bf16"),
        subspace_dim=8,
        schedule="gpipe",
        update_every=3,
        seed=5,
    )
    # A bad value fails while the CLI parses, naming the field (nothing is launched) ...
    with pytest.raises(SystemExit):
        build_cli(["--config", str(config), "--trainer.strategy.init_args.settings.update_lr", "-1"], run=False)
    assert "SubspacePipelineSettings.update_lr=-1.0: use a finite number > 0" in capsys.readouterr().err
    # ... and so does a 0.1 key, naming where it went.
    with pytest.raises(SystemExit):
        build_cli(["--config", str(config), "--trainer.strategy.init_args.rank", "8"], run=False)
    assert "'rank' -> 'settings.subspace_dim'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (SubspacePipelineSettings(subspace_dim=200), r"settings\.subspace_dim=200 exceeds the model width d=128"),
        (SubspacePipelineSettings(dim_ratio=1000.0), r"settings\.dim_ratio=1000\.0 leaves k = round\(128 / 1000\.0\)"),
    ],
)
def test_a_subspace_wider_than_the_model_names_the_setting(settings: SubspacePipelineSettings, match: str) -> None:
    """The model width is known only at setup; the error names the strategy's setting, not SubspaceConfig's."""
    runtime = SubspacePipelineRuntime(settings)
    with pytest.raises(ValueError, match=match):
        runtime.check_width(128)
    runtime.check_width(1000 if settings.subspace_dim is None else 200)  # wide enough: no error


@pytest.mark.parametrize("cls", ADAPTERS)
def test_the_base_builds_the_runtime_and_names_the_fix_for_an_unknown_keyword(cls: type) -> None:
    assert cls.settings_class is SubspacePipelineSettings and cls.runtime_class is SubspacePipelineRuntime
    strategy = cls()
    assert (
        isinstance(strategy.runtime, SubspacePipelineRuntime) and strategy.runtime.owner == "SubspacePipelineStrategy"
    )
    with pytest.raises(
        TypeError,
        match=r"SubspacePipelineStrategy: unexpected keyword argument 'bogus'.*settings=SubspacePipelineSettings\(",
    ):
        cls(bogus=1)
