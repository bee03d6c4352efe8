"""MatFormerSettings: every check names its field, defaults are 0.1's, old adapter keywords fail naming the new key,
the object is frozen, and a YAML ``init_args.settings`` reaches the strategy through LightningCLI."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from lightning_hetero import MatFormerStrategy
from lightning_hetero.cli import build_cli
from lightning_hetero.core.settings import RenamedSettingError
from lightning_hetero.fabric import MatFormerStrategy as FabricMatFormerStrategy
from lightning_hetero.matformer.runtime import MatFormerRuntime
from lightning_hetero.matformer.settings import MatFormerSettings
from lightning_hetero.replication.settings import ReplicationSettings

STRATEGIES = [MatFormerStrategy, FabricMatFormerStrategy]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tiers": [0, 1], "widths": [64, 32]}, r"MatFormerSettings.tiers=\[0, 1\] and MatFormerSettings.widths=.*not"),
        ({"tiers": [1, 0]}, r"MatFormerSettings.tiers=\[1, 0\]: global rank 0 must be tier 0.*tiers=\[0, 1, 2\]"),
        ({"tiers": [[0, 1], 0]}, r"MatFormerSettings.tiers=.*global rank 0 must be tier 0"),
        ({"tiers": [0, -1]}, r"MatFormerSettings.tiers=\[0, -1\]: entry 1 \(-1\) must be an int >= 0"),
        ({"tiers": [0, True]}, r"MatFormerSettings.tiers=\[0, True\]: entry 1"),
        ({"tiers": []}, r"MatFormerSettings.tiers=\[\]: give a non-empty list"),
        ({"widths": [64, 0]}, r"MatFormerSettings.widths=\[64, 0\]: entry 1 \(0\) must be an int >= 1"),
        ({"mode": "avg"}, r"MatFormerSettings.mode='avg': use one of \['mean', 'sign', 'demo'\]"),
        ({"tier_weights": [1.0, 0.0]}, r"MatFormerSettings.tier_weights=\[1.0, 0.0\]: weight 1 must be finite and > 0"),
        ({"tier_weights": [1.0, math.inf]}, r"MatFormerSettings.tier_weights=.*weight 1 must be finite"),
        ({"tier_weights": []}, r"MatFormerSettings.tier_weights=\[\]: give a list with one weight per tier"),
        (
            {"tiers": [0, 1, 2], "tier_weights": [1.0, 2.0]},
            r"MatFormerSettings.tier_weights=.*one weight per tier 0\.\.2",
        ),
        ({"helper_fraction": 0.5}, r"MatFormerSettings.helper_fraction=0.5 with slice_weights=True.*slice_weights=Fa"),
        ({"helper_fraction": -1.0, "slice_weights": False}, r"MatFormerSettings.helper_fraction=-1.0: use a number >="),
        ({"helper_fraction": math.nan, "slice_weights": False}, r"MatFormerSettings.helper_fraction=nan"),
        ({"helper_redraw_every": 0}, r"MatFormerSettings.helper_redraw_every=0: use an int >= 1"),
        ({"helper_seed": 1.5}, r"MatFormerSettings.helper_seed=1.5: use an int"),
        ({"slice_weights": "yes"}, r"MatFormerSettings.slice_weights='yes': use true or false"),
        ({"log_tier_losses": 1}, r"MatFormerSettings.log_tier_losses=1: use true or false"),
        ({"on_bad_payload": "warn"}, r"MatFormerSettings.on_bad_payload='warn': use one of \['raise', 'drop'\]"),
        (
            {"replication": ReplicationSettings(kept_fraction=0.25)},
            r"MatFormerSettings.replication=.* with mode='mean'.*remove replication or set mode='demo'",
        ),
        (
            {"mode": "demo", "replication": ReplicationSettings(kind="topk")},
            r"MatFormerSettings.replication.kind='topk'.*set kind='demo'",
        ),
        (
            {"mode": "demo", "replication": ReplicationSettings(combine="pickers")},
            r"MatFormerSettings.replication.combine='pickers'.*leave combine at 'mean'",
        ),
        ({"mode": "demo", "replication": {"chunk": 8}}, r"MatFormerSettings.replication=\{'chunk': 8\}: use Replic"),
        (
            {"mode": "demo", "helper_fraction": 0.5, "slice_weights": False},
            r"MatFormerSettings.helper_fraction=0.5 with mode='demo'.*Set helper_fraction=0",
        ),
    ],
)
def test_every_error_names_the_field_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MatFormerSettings(**kwargs)


def test_replication_fields_are_checked_by_the_replication_settings():
    with pytest.raises(ValueError, match=r"ReplicationSettings.kept_fraction=0.0: use a fraction in \(0, 1\]"):
        MatFormerSettings(mode="demo", replication=ReplicationSettings(kept_fraction=0.0))
    with pytest.raises(ValueError, match=r"ReplicationSettings.index_bits=12: cannot address chunk=128"):
        MatFormerSettings(mode="demo", replication=ReplicationSettings(chunk=128, index_bits=12))


def test_defaults_are_the_behaviour_of_0_1():
    settings = MatFormerSettings()
    assert (settings.tiers, settings.widths, settings.mode, settings.tier_weights) == (None, None, "mean", None)
    assert (settings.helper_fraction, settings.helper_redraw_every, settings.helper_seed) == (0.0, 16, 0)
    assert settings.slice_weights is True and settings.log_tier_losses is False
    assert settings.on_bad_payload == "raise" and settings.replication is None
    # mode="demo" without replication: 1/32 of the DCT coefficients per 64x64 chunk, fp32 values, index bits from chunk
    demo = ReplicationSettings()
    assert (demo.kept_fraction, demo.chunk, demo.values, demo.index_bits, demo.combine) == (
        1 / 32,
        64,
        "fp32",
        None,
        "mean",
    )
    for cls in STRATEGIES:
        assert cls().settings == settings
    assert MatFormerRuntime(settings).owner == "MatFormerStrategy"


def test_entries_are_normalised_copies_and_the_settings_are_frozen():
    tiers = [0, [1, 0], 1]
    settings = MatFormerSettings(tiers=tiers, tier_weights=[1, 2])
    tiers[1].append(5)
    tiers.append(7)
    assert settings.tiers == [0, [1, 0], 1] and settings.tier_weights == [1.0, 2.0]
    assert settings.unit == "tier" and settings.uniform_tiers is None
    assert MatFormerSettings(tiers=[0, 2, 2, 1]).uniform_tiers == [0, 1, 2]
    assert MatFormerSettings(widths=[64, 32]).unit == "width" and MatFormerSettings(widths=[64]).uniform_tiers is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.mode = "sign"  # type: ignore[misc]


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize("old", sorted(MatFormerSettings.RENAMED))
def test_every_renamed_keyword_fails_naming_the_new_key(cls, old):
    new = MatFormerSettings.RENAMED[old]
    with pytest.raises(
        RenamedSettingError, match=re.escape(f"{cls.__name__}: '{old}' renamed in 0.2 ('{old}' -> '{new}')")
    ):
        cls(**{old: None})


def test_renamed_covers_every_keyword_of_0_1():
    # The adapters' own keywords in 0.1 (the union of the Trainer and Fabric signatures).
    old = {
        "tiers",
        "widths",
        "mode",
        "tier_weights",
        "helper_fraction",
        "helper_redraw_every",
        "helper_seed",
        "slice_weights",
        "compression",
        "demo_options",
        "log_tier_losses",
        "on_bad_payload",
    }
    assert set(MatFormerSettings.RENAMED) == old
    fields = {field.name for field in dataclasses.fields(MatFormerSettings)}
    for key, target in MatFormerSettings.RENAMED.items():
        assert target.startswith("settings."), key
        assert target.removeprefix("settings.").split(".")[0] in fields, key


# ---------------------------------------------------------------------------------------------------- CLI
_YAML = """\
model: lightning.pytorch.demos.boring_classes.BoringModel
trainer:
  accelerator: cpu
  devices: 2
  logger: false
  strategy:
    class_path: MatFormerStrategy
    init_args:
      start_method: spawn
      settings:
{settings}
"""


def _cli(tmp_path: Path, settings: str):
    config = tmp_path / "config.yaml"
    config.write_text(_YAML.format(settings=settings))
    return build_cli(["--config", str(config)], run=False)


def test_yaml_settings_reach_the_strategy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = _cli(
        tmp_path,
        "        tiers: [0, 1]\n        mode: demo\n        replication: {kept_fraction: 0.25, chunk: 16}\n"
        "        log_tier_losses: true",
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MatFormerStrategy) and strategy._start_method == "spawn"
    expected = MatFormerSettings(
        tiers=[0, 1], mode="demo", replication=ReplicationSettings(kept_fraction=0.25, chunk=16), log_tier_losses=True
    )
    assert strategy.settings == expected
    assert strategy.tiers == [0, 1]  # checked against the 2 devices when the Trainer was built


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ("        helper_redraw_every: 0", "MatFormerSettings.helper_redraw_every=0"),
        ("        mode: demo\n        replication: {kept_fraction: 1.5}", "ReplicationSettings.kept_fraction=1.5"),
    ],
)
def test_an_invalid_yaml_value_fails_before_training_naming_the_field(tmp_path, monkeypatch, capsys, settings, named):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):  # while LightningCLI builds the strategy, like any bad argument
        _cli(tmp_path, settings)
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("old", "new"), [("tiers: [0, 1]", "settings.tiers"), ("compression: 0.25", "settings.replication.kept_fraction")]
)
def test_a_0_1_key_under_init_args_fails_naming_the_new_key(tmp_path, monkeypatch, capsys, old, new):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(_YAML.replace("      settings:\n{settings}\n", f"      {old}\n"))
    with pytest.raises(SystemExit):
        build_cli(["--config", str(config)], run=False)
    assert f"-> '{new}'" in capsys.readouterr().err


@pytest.mark.parametrize("cls", [MatFormerStrategy, FabricMatFormerStrategy])
def test_the_base_builds_the_runtime_and_names_the_fix_for_an_unknown_keyword(cls: type) -> None:
    assert cls.settings_class is MatFormerSettings and cls.runtime_class is MatFormerRuntime
    strategy = cls()
    assert isinstance(strategy.runtime, MatFormerRuntime) and strategy.runtime.owner == "MatFormerStrategy"
    with pytest.raises(
        TypeError, match=r"MatFormerStrategy: unexpected keyword argument 'bogus'.*settings=MatFormerSettings\("
    ):
        cls(bogus=1)
