"""FlexDeMoSettings: each bad field is refused naming it, the defaults, old keywords name their new place."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hetero.core.settings import RenamedSettingError
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.replication import ReplicationSettings, build_replicator
from lightning_hetero.strategies.flexdemo.fabric import FlexDeMoStrategy as FabricFlexDeMoStrategy
from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy

ADAPTERS = [FlexDeMoStrategy, FabricFlexDeMoStrategy]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"replication": {"kind": "demo"}}, "replication"),  # a dict in Python: use ReplicationSettings(...)
        ({"shard_size": 0}, "shard_size"),
        ({"shard_size": 1.5}, "shard_size"),
        ({"shard_size": True}, "shard_size"),
        ({"drift_check_every": -1}, "drift_check_every"),
        ({"drift_check_every": None}, "drift_check_every"),
        ({"overlap": "yes"}, "overlap"),
        ({"activation_checkpointing": 1}, "activation_checkpointing"),
        ({"block_classes": "LlamaDecoderLayer"}, "block_classes"),
        ({"block_classes": ["LlamaDecoderLayer", 3]}, "block_classes"),
        ({"block_classes": []}, "block_classes"),
        ({"on_bad_payload": "ignore"}, "on_bad_payload"),
        ({"log_comm_stats": None}, "log_comm_stats"),
        ({"adamw_exchange": "moments"}, "adamw_exchange"),
        ({"preconditioner_beta2": 1.0}, "preconditioner_beta2"),
        ({"preconditioner_beta2": "0.999"}, "preconditioner_beta2"),
        ({"preconditioner_beta2": True}, "preconditioner_beta2"),
    ],
)
def test_invalid_field_is_named(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"FlexDeMoSettings\.{field}="):
        FlexDeMoSettings(**kwargs)


def test_defaults() -> None:
    settings = FlexDeMoSettings()
    assert (settings.shard_size, settings.drift_check_every, settings.block_classes) == (None, 0, None)
    assert settings.overlap and not settings.activation_checkpointing and settings.log_comm_stats
    assert settings.on_bad_payload == "raise" and settings.replication == ReplicationSettings()
    assert settings.adamw_exchange == "preconditioned"  # 0.2: measured better than 0.1's "direction"
    assert settings.preconditioner_beta2 == 0.999  # measured better than LLM recipes' 0.95 under "preconditioned"
    for cls in ADAPTERS:  # no replicator chosen: demo at 1/32 on two or more copies (full on one, at setup)
        runtime = cls().runtime
        assert runtime.settings == settings and not runtime.replicator_chosen and runtime.compresses
        assert runtime.make_replicator().describe() == build_replicator("demo", 1 / 32).describe()


def test_block_classes_list_becomes_a_tuple_and_settings_are_frozen() -> None:
    settings = FlexDeMoSettings(block_classes=["LlamaDecoderLayer"])  # type: ignore[arg-type]
    assert settings.block_classes == ("LlamaDecoderLayer",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.shard_size = 2  # type: ignore[misc]


@pytest.mark.parametrize("cls", ADAPTERS)
def test_adapter_holds_the_settings(cls: type) -> None:
    settings = FlexDeMoSettings(shard_size=2, replication=ReplicationSettings(kind="random", kept_fraction=0.25))
    strategy = cls(settings=settings)
    assert strategy.settings is settings and strategy.runtime.settings is settings
    assert cls.settings_class is FlexDeMoSettings
    assert strategy.runtime.make_replicator().name == "random"
    with pytest.raises(AttributeError):
        strategy.settings = FlexDeMoSettings()  # read-only


@pytest.mark.parametrize("cls", ADAPTERS)
@pytest.mark.parametrize(("old", "new"), sorted(FlexDeMoSettings.RENAMED.items()))
def test_every_renamed_keyword_names_its_new_place(cls: type, old: str, new: str) -> None:
    with pytest.raises(RenamedSettingError, match=rf"'{old}' -> '{new}'"):
        cls(**{old: None})


def test_renamed_table_covers_every_old_keyword() -> None:
    """Every 0.1 adapter keyword (Trainer and Fabric) is listed, and each points at a settings field."""
    old = {
        "replicator", "compression", "replicator_options", "shard_size", "drift_check_every", "overlap",
        "activation_checkpointing", "block_classes", "on_bad_payload", "log_comm_stats",
    }  # fmt: skip
    assert set(FlexDeMoSettings.RENAMED) == old
    fields = {f.name for f in dataclasses.fields(FlexDeMoSettings)}
    replication = {f.name for f in dataclasses.fields(ReplicationSettings)}
    for new in FlexDeMoSettings.RENAMED.values():
        path = new.split(".")
        assert path[0] == "settings" and path[1] in fields
        assert len(path) == 2 or path[2] in replication
