"""ReplicationSettings: each invalid field is refused naming it, defaults build today's replicators, build() matches."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hetero.replication import (
    DeMoReplicator,
    DiLoCoReplicator,
    FullReplicator,
    RandomReplicator,
    ReplicationSettings,
    StridingReplicator,
    TopKReplicator,
    build_replicator,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "nope"}, "kind"),
        ({"kept_fraction": 0.0}, "kept_fraction"),
        ({"kept_fraction": 1.5}, "kept_fraction"),
        ({"kept_fraction": True}, "kept_fraction"),
        ({"values": "int8"}, "values"),
        ({"chunk": 0}, "chunk"),
        ({"chunk": 257}, "chunk"),
        ({"index_bits": 8}, "index_bits"),
        ({"chunk": 128, "index_bits": 12}, "index_bits"),
        ({"combine": "sum"}, "combine"),
        ({"kind": "random", "seed": 1.5}, "seed"),
        ({"kind": "diloco", "sync_every": 0}, "sync_every"),
        ({"kind": "diloco", "outer_lr": 0.0}, "outer_lr"),
        ({"kind": "diloco", "outer_momentum": 1.0}, "outer_momentum"),
        ({"kind": "diloco", "outer_kept_fraction": 0.0}, "outer_kept_fraction"),
        ({"kind": "diloco", "outer_kept_fraction": 0.5, "outer_chunk": 0}, "outer_chunk"),
        ({"kind": "diloco", "outer_chunk": 8}, "outer_chunk"),  # only with outer_kept_fraction
        ({"sync_every": 4}, "sync_every"),  # kind None: demo/full, not diloco
        ({"kind": "demo", "outer_lr": 0.5}, "outer_lr"),
        ({"kind": "full", "kept_fraction": 0.5}, "kept_fraction"),
        ({"kind": "diloco", "kept_fraction": 0.5}, "kept_fraction"),  # DiLoCo's period is sync_every
        ({"kind": "striding", "chunk": 8}, "chunk"),
        ({"kind": "demo", "seed": 3}, "seed"),
    ],
)
def test_invalid_field_is_named(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"ReplicationSettings\.{field}="):
        ReplicationSettings(**kwargs)


def test_defaults_are_the_old_defaults() -> None:
    settings = ReplicationSettings()
    assert settings.kind is None and settings.kept_fraction == 1 / 32 and not settings.explicit
    assert ReplicationSettings(kind="demo").explicit and ReplicationSettings(values="bf16").explicit
    assert settings.build().describe() == build_replicator("demo").describe()
    assert settings.build("full").describe() == build_replicator("full").describe()


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ReplicationSettings().kind = "full"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("settings", "cls", "old"),
    [
        (
            ReplicationSettings(kind="demo", kept_fraction=0.25, chunk=4, values="sign"),
            DeMoReplicator,
            ("demo", 0.25, {"chunk": 4, "values": "sign"}),
        ),
        (
            ReplicationSettings(kind="topk", chunk=32, index_bits=16, combine="pickers"),
            TopKReplicator,
            ("topk", 1 / 32, {"chunk": 32, "index_bits": 16, "combine": "pickers"}),
        ),
        (ReplicationSettings(kind="random", kept_fraction=0.5, seed=7), RandomReplicator, ("random", 0.5, {"seed": 7})),
        (
            ReplicationSettings(kind="striding", values="bf16"),
            StridingReplicator,
            ("striding", 1 / 32, {"values": "bf16"}),
        ),
        (ReplicationSettings(kind="full", values="ternary"), FullReplicator, ("full", 1 / 32, {"values": "ternary"})),
        (
            ReplicationSettings(
                kind="diloco", sync_every=4, outer_lr=0.5, outer_momentum=0.8, outer_kept_fraction=0.25, outer_chunk=8
            ),
            DiLoCoReplicator,
            (
                "diloco",
                1 / 4,
                {
                    "sync_every": 4,
                    "outer_lr": 0.5,
                    "outer_momentum": 0.8,
                    "outer_kept_fraction": 0.25,
                    "outer_chunk": 8,
                },
            ),
        ),
    ],
)
def test_build_matches_build_replicator(settings: ReplicationSettings, cls: type, old: tuple) -> None:
    name, kept_fraction, options = old
    built = settings.build()
    assert type(built) is cls
    assert built.describe() == build_replicator(name, kept_fraction, **options).describe()
    assert settings.build() is not built  # a fresh replicator each time (they hold per-run state)


def test_diloco_default_period_is_32() -> None:
    replicator = ReplicationSettings(kind="diloco").build()
    assert isinstance(replicator, DiLoCoReplicator) and replicator.sync_every == 32 and replicator.outer_codec is None


def test_one_table_maps_each_kind_to_its_class():
    from typing import get_args

    from lightning_hetero import replication
    from lightning_hetero.replication import settings as settings_module

    assert replication.REPLICATORS is settings_module.REPLICATORS  # declared once, re-exported
    assert set(settings_module.REPLICATORS) == set(get_args(settings_module.ReplicatorKind))
    for kind, cls in settings_module.REPLICATORS.items():
        if kind != "diloco":  # diloco takes no compression
            assert type(ReplicationSettings(kind=kind).build()) is cls
