"""``batch_share`` in FlexDeMoSettings and MatFormerSettings: from Python and from YAML, refused values name the
field and the fix, and the Fabric adapters say they are Trainer-only."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_hetero import FlexDeMoStrategy, MatFormerStrategy
from lightning_hetero.cli import build_cli
from lightning_hetero.fabric import FlexDeMoStrategy as FabricFlexDeMoStrategy
from lightning_hetero.fabric import MatFormerStrategy as FabricMatFormerStrategy
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.matformer.settings import MatFormerSettings

SETTINGS = [(FlexDeMoSettings, "FlexDeMoSettings"), (MatFormerSettings, "MatFormerSettings")]


@pytest.mark.parametrize(("cls", "owner"), SETTINGS)
def test_python_values(cls, owner):
    assert cls().batch_share is None
    assert cls(batch_share="auto").batch_share == "auto"
    shares = [3, 1]
    settings = cls(batch_share=shares)
    assert settings.batch_share == (3.0, 1.0)
    shares.append(7)
    assert settings.batch_share == (3.0, 1.0)  # a normalised copy


@pytest.mark.parametrize(("cls", "owner"), SETTINGS)
@pytest.mark.parametrize(
    ("value", "hint"),
    [("fast", "use 'auto'"), ([], "use 'auto'"), (2, "use 'auto'"), ([1, -1], "entry 1"), ([1, float("inf")], "> 0")],
)
def test_bad_values_name_the_field_and_the_fix(cls, owner, value, hint):
    with pytest.raises(ValueError, match=rf"{owner}\.batch_share=.*{hint}"):
        cls(batch_share=value)


def test_flexdemo_refuses_batch_share_with_fault_tolerance():
    ft = FaultToleranceSettings(lighthouse="http://localhost:1", replica_id_source="fixed", replica_id="solo")
    with pytest.raises(ValueError, match=r"FlexDeMoSettings\.batch_share=.*set batch_share=None or drop"):
        FlexDeMoSettings(batch_share="auto", fault_tolerance=ft)


@pytest.mark.parametrize(
    ("cls", "settings"),
    [
        (FabricFlexDeMoStrategy, FlexDeMoSettings(batch_share=[1, 2])),
        (FabricMatFormerStrategy, MatFormerSettings(batch_share="auto")),
    ],
)
def test_fabric_adapters_say_trainer_only(cls, settings):
    with pytest.raises(ValueError, match="Trainer-only"):
        cls(settings=settings)


_YAML = """\
model: lightning.pytorch.demos.boring_classes.BoringModel
trainer:
  accelerator: cpu
  devices: 2
  logger: false
  strategy:
    class_path: {strategy}
    init_args:
      start_method: spawn
      settings:
        batch_share: {share}
"""


@pytest.mark.parametrize(
    ("strategy", "cls"), [("FlexDeMoStrategy", FlexDeMoStrategy), ("MatFormerStrategy", MatFormerStrategy)]
)
@pytest.mark.parametrize(
    ("share", "expected"), [("auto", "auto"), ("[0.75, 0.25]", (0.75, 0.25)), ("[3, 1]", (3.0, 1.0))]
)
def test_yaml_reaches_the_strategy(tmp_path: Path, monkeypatch, strategy, cls, share, expected):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(_YAML.format(strategy=strategy, share=share))
    built = build_cli(["--config", str(config)], run=False).trainer.strategy
    assert isinstance(built, cls) and built.settings.batch_share == expected


def test_a_bad_yaml_value_fails_before_training_naming_the_field(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(_YAML.format(strategy="FlexDeMoStrategy", share="[1, 0]"))
    with pytest.raises(SystemExit):
        build_cli(["--config", str(config)], run=False)
    assert "batch_share" in capsys.readouterr().err
