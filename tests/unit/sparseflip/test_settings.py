"""SparseFlipSettings: every bad value fails naming its field, defaults are 0.1's, old keywords name their new key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, get_args

import pytest

from lightning_hetero import SparseFlipStrategy
from lightning_hetero.core.settings import RenamedSettingError
from lightning_hetero.fabric import SparseFlipStrategy as FabricSparseFlipStrategy
from lightning_hetero.sparseflip import CodeExchangeSettings, FlipSettings, FpSyncSettings, SparseFlipSettings
from lightning_hetero.sparseflip.runtime import SparseFlipRuntime

ADAPTERS = [SparseFlipStrategy, FabricSparseFlipStrategy]
REPO = Path(__file__).resolve().parents[3]

OLD_DEFAULTS: dict[str, Any] = {
    "kind": "ternary",
    "granularity": "row",
    "flip_rule": "local_bop",
    "send_fraction": 1.0,
    "flips_per_step": None,
    "flip_fraction": None,
    "bop_gamma": 0.03,
    "bop_threshold": 0.2,
    "bop_decay_to": 0.1,
    "trainable_scale": True,
    "zero_fraction": 0.5,
    "tau": None,
    "density": None,
    "encoding": "sign",
    "aggregation": "server",
    "server": 0,
    "skip": None,
    "include": None,
    "drift_check_every": 0,
    "on_nonfinite": "raise",
    "fp_density": None,
    "log_comm_stats": True,
    "on_bad_payload": "raise",
}
"""Every keyword of the 0.1 adapters with its default (``SparseFlipStrategy.__init__`` before the settings)."""


def _resolve(settings: SparseFlipSettings, path: str) -> Any:
    """The value at ``"settings.flip.rule"``-style ``path``."""
    head, *names = path.split(".")
    assert head == "settings"
    value: Any = settings
    for name in names:
        value = getattr(value, name)
    return value


def test_renamed_covers_every_old_keyword_and_points_at_a_field():
    assert set(SparseFlipSettings.RENAMED) == set(OLD_DEFAULTS)
    for new in SparseFlipSettings.RENAMED.values():
        _resolve(SparseFlipSettings(), new)  # raises AttributeError for a path that is not a field


@pytest.mark.parametrize("old", sorted(OLD_DEFAULTS))
def test_defaults_equal_the_old_keyword_defaults(old):
    assert _resolve(SparseFlipSettings(), SparseFlipSettings.RENAMED[old]) == OLD_DEFAULTS[old]


def test_choices_are_the_ones_the_exchange_and_the_codecs_accept():
    from lightning_hetero.comm.payload_packing import VALUE_ENCODINGS
    from lightning_hetero.comm.validation import BAD_PAYLOAD_POLICIES
    from lightning_hetero.sparseflip import settings as module
    from lightning_hetero.sparseflip.sparse import EXCHANGE_MODES

    assert set(get_args(module.Encoding)) == set(VALUE_ENCODINGS)
    assert set(get_args(module.Aggregation)) == set(EXCHANGE_MODES)
    assert set(get_args(module.BadPayloadPolicy)) == set(BAD_PAYLOAD_POLICIES)


def test_error_feedback_defaults_on_as_the_runtime_did():
    assert SparseFlipSettings().exchange.error_feedback is True


@pytest.mark.parametrize("cls", ADAPTERS, ids=["trainer", "fabric"])
@pytest.mark.parametrize("old", sorted(OLD_DEFAULTS))
def test_every_old_keyword_raises_naming_its_new_key(cls, old):
    with pytest.raises(RenamedSettingError, match=f"'{old}' -> '{SparseFlipSettings.RENAMED[old]}'"):
        cls(**{old: OLD_DEFAULTS[old]})


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: SparseFlipSettings(kind="quaternary"), "SparseFlipSettings.kind='quaternary'"),
        (lambda: SparseFlipSettings(granularity="column"), "SparseFlipSettings.granularity='column'"),
        (lambda: SparseFlipSettings(trainable_scale=1), "SparseFlipSettings.trainable_scale=1"),
        (lambda: SparseFlipSettings(zero_fraction=1.0), "SparseFlipSettings.zero_fraction=1.0"),
        (lambda: SparseFlipSettings(zero_fraction=-0.1), "SparseFlipSettings.zero_fraction=-0.1"),
        (lambda: SparseFlipSettings(skip="lm_head"), "SparseFlipSettings.skip='lm_head'"),
        (lambda: SparseFlipSettings(include=["Embedding"]), r"SparseFlipSettings.include=\['Embedding'\]"),
        (lambda: SparseFlipSettings(flip={"rule": "topk"}), "SparseFlipSettings.flip="),
        (lambda: SparseFlipSettings(drift_check_every=-1), "SparseFlipSettings.drift_check_every=-1"),
        (lambda: SparseFlipSettings(on_nonfinite="ignore"), "SparseFlipSettings.on_nonfinite='ignore'"),
        (lambda: SparseFlipSettings(on_bad_payload="log"), "SparseFlipSettings.on_bad_payload='log'"),
        (lambda: SparseFlipSettings(log_comm_stats="yes"), "SparseFlipSettings.log_comm_stats='yes'"),
        (lambda: FlipSettings(rule="vote"), "SparseFlipSettings.flip.rule='vote'"),
        (lambda: FlipSettings(max_per_step=0), "SparseFlipSettings.flip.max_per_step=0"),
        (lambda: FlipSettings(max_per_step=True), "SparseFlipSettings.flip.max_per_step=True"),
        (lambda: FlipSettings(max_fraction=2.0), "SparseFlipSettings.flip.max_fraction=2.0"),
        (lambda: FlipSettings(bop_gamma=0.0), "SparseFlipSettings.flip.bop_gamma=0.0"),
        (lambda: FlipSettings(bop_threshold=-1.0), "SparseFlipSettings.flip.bop_threshold=-1.0"),
        (lambda: FlipSettings(bop_decay_to=1.5), "SparseFlipSettings.flip.bop_decay_to=1.5"),
        (lambda: CodeExchangeSettings(send_threshold=0.1, kept_fraction=0.1), "not both"),
        (lambda: CodeExchangeSettings(send_threshold=float("nan")), "SparseFlipSettings.exchange.send_threshold=nan"),
        (lambda: CodeExchangeSettings(kept_fraction=0.0), "SparseFlipSettings.exchange.kept_fraction=0.0"),
        (
            lambda: CodeExchangeSettings(send_threshold_ratio=-1.0),
            "SparseFlipSettings.exchange.send_threshold_ratio=-1.0",
        ),
        (lambda: CodeExchangeSettings(encoding="fp8"), "SparseFlipSettings.exchange.encoding='fp8'"),
        (lambda: CodeExchangeSettings(aggregation="gossip"), "SparseFlipSettings.exchange.aggregation='gossip'"),
        (lambda: CodeExchangeSettings(server=-1), "SparseFlipSettings.exchange.server=-1"),
        (lambda: CodeExchangeSettings(error_feedback=None), "SparseFlipSettings.exchange.error_feedback=None"),
        (lambda: FpSyncSettings(kept_fraction=0.0), "SparseFlipSettings.fp_sync.kept_fraction=0.0"),
        (lambda: FpSyncSettings(kept_fraction=1.5), "SparseFlipSettings.fp_sync.kept_fraction=1.5"),
    ],
)
def test_bad_values_fail_naming_the_field(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_lists_become_tuples_and_the_settings_are_frozen_and_hashable():
    settings = SparseFlipSettings(skip=["lm_head"], include=["Linear"], flip=FlipSettings(max_per_step=4))
    assert settings.skip == ("lm_head",) and settings.include == ("Linear",)
    assert hash(settings) == hash(
        SparseFlipSettings(skip=("lm_head",), include=("Linear",), flip=FlipSettings(max_per_step=4))
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.kind = "binary"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.flip.max_per_step = 8  # type: ignore[misc]


@pytest.mark.parametrize("cls", ADAPTERS, ids=["trainer", "fabric"])
def test_adapters_hold_the_settings_they_were_given(cls):
    settings = SparseFlipSettings(kind="binary", exchange=CodeExchangeSettings(aggregation="allgather"))
    strategy = cls(settings=settings)
    assert strategy.settings is settings and strategy.runtime.settings is settings
    assert cls.settings_class is SparseFlipSettings
    assert cls().settings == SparseFlipSettings()
    with pytest.raises(AttributeError):
        strategy.settings = SparseFlipSettings()  # read-only


def test_runtime_refuses_anything_but_settings():
    with pytest.raises(TypeError, match="pass settings=SparseFlipSettings"):
        SparseFlipRuntime({"kind": "binary"})  # type: ignore[arg-type]


def test_yaml_settings_reach_the_strategy_and_a_bad_value_fails_before_training(tmp_path, monkeypatch):
    from lightning_hetero.cli import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    override = tmp_path / "strategy.yaml"
    override.write_text(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: lightning_hetero.SparseFlipStrategy\n"
        "    init_args:\n"
        "      settings:\n"
        "        kind: binary\n"
        "        skip: [lm_head]\n"
        "        flip: {rule: topk, max_per_step: 7}\n"
        "        exchange: {kept_fraction: 0.05, encoding: bf16}\n"
        "        fp_sync: {kept_fraction: 0.25}\n"
    )
    base = str(REPO / "configs" / "sparseflip_vit_mnist.yaml")
    cli = build_cli(["--config", base, "--config", str(override)], run=False)
    settings = cli.trainer.strategy.settings
    assert settings == SparseFlipSettings(
        kind="binary",
        skip=("lm_head",),
        flip=FlipSettings(rule="topk", max_per_step=7),
        exchange=CodeExchangeSettings(kept_fraction=0.05, encoding="bf16"),
        fp_sync=FpSyncSettings(kept_fraction=0.25),
        drift_check_every=50,  # from the base config
    )
    bad = ["--config", base, "--trainer.strategy.init_args.settings.flip.max_per_step=0"]
    with pytest.raises((ValueError, SystemExit)) as caught:
        build_cli(bad, run=False)
    chain, error = [], caught.value
    while error is not None:  # jsonargparse wraps the settings' ValueError in its own
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert "SparseFlipSettings.flip.max_per_step=0: use an int >= 1" in "\n".join(chain)


@pytest.mark.parametrize("cls", ADAPTERS)
def test_the_base_builds_the_runtime_and_names_the_fix_for_an_unknown_keyword(cls: type) -> None:
    assert cls.settings_class is SparseFlipSettings and cls.runtime_class is SparseFlipRuntime
    strategy = cls()
    assert isinstance(strategy.runtime, SparseFlipRuntime) and strategy.runtime.owner == "SparseFlipStrategy"
    with pytest.raises(
        TypeError, match=r"SparseFlipStrategy: unexpected keyword argument 'bogus'.*settings=SparseFlipSettings\("
    ):
        cls(bogus=1)
