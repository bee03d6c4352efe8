"""``MatFormerSettings.fault_tolerance``: accepted from Python, what the mode refuses (naming the setting and the fix),
each node's tier from its replica-group index, and the launch check (one rank per launch, one node per launch)."""

from __future__ import annotations

import pytest

from lightning_hetero import MatFormerStrategy
from lightning_hetero.core import WorldLayout
from lightning_hetero.fabric import MatFormerStrategy as FabricMatFormerStrategy
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.matformer.runtime import MatFormerRuntime
from lightning_hetero.matformer.settings import MatFormerSettings, node_entry

FT = FaultToleranceSettings(lighthouse="http://head:29510", min_replicas=2, num_replica_groups=3)


def _spot(**kwargs: object) -> MatFormerSettings:
    return MatFormerSettings(**{"tiers": [1, 0, 1], "slice_weights": False, "fault_tolerance": FT, **kwargs})


def test_the_mode_takes_one_entry_per_node_and_any_node_may_be_first():
    settings = _spot()
    assert settings.fault_tolerance is FT and settings.tiers == [1, 0, 1]
    assert MatFormerSettings().fault_tolerance is None
    with pytest.raises(ValueError, match="global rank 0 must be tier 0"):  # outside the mode the rule stays
        MatFormerSettings(tiers=[1, 0, 1], slice_weights=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tiers": "auto"}, r"tiers='auto'.*one entry per replica group"),
        ({"slice_weights": True}, r"slice_weights=True.*Set slice_weights: false"),
        ({"mode": "sign"}, r"mode='sign': only the per-region mean"),
        ({"tier_weights": [1.0, 1.0]}, r"tier_weights=\[1.0, 1.0\]"),
        ({"helper_fraction": 0.25}, r"helper_fraction=0.25"),
        ({"batch_share": [0.5, 0.5]}, r"batch_share"),
        ({"tiers": [0, 1]}, r"has 2 entries but fault_tolerance.num_replica_groups=3"),
        ({"fault_tolerance": {"min_replicas": 2}}, r"use FaultToleranceSettings"),
    ],
)
def test_what_the_mode_cannot_run_is_refused_naming_the_setting_and_docs(kwargs, match):
    with pytest.raises(ValueError, match=match) as error:
        _spot(**kwargs)
    assert "docs/spot.md" in str(error.value) or "FaultToleranceSettings" in str(error.value)


def test_each_node_trains_the_entry_of_its_replica_group(monkeypatch):
    settings = _spot()
    for group, tier in enumerate([1, 0, 1]):
        monkeypatch.setenv("REPLICA_GROUP_ID", f"node-{group}")
        assert node_entry("M", settings) == tier
    monkeypatch.setenv("REPLICA_GROUP_ID", "node-3")
    unbounded = _spot(fault_tolerance=FaultToleranceSettings(min_replicas=2))
    with pytest.raises(ValueError, match=r"replica group 3 .* has no entry 3"):
        node_entry("M", unbounded)
    assert node_entry("M", _spot(tiers=None, fault_tolerance=FaultToleranceSettings())) == 0


def test_the_launch_check_needs_no_replica_id_the_node_entry_comes_at_setup(monkeypatch):
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)  # e.g. --print_config, or building the Trainer in a test
    runtime = MatFormerRuntime(_spot())
    runtime.resolve_launch(WorldLayout(num_nodes=1, ranks_per_node=1))
    assert runtime.per_rank is None and runtime.tier_of(0) is None


def test_a_launch_of_several_ranks_or_nodes_is_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    runtime = MatFormerRuntime(_spot())
    with pytest.raises(ValueError, match=r"has 2 ranks.*ONE rank.*devices=1.*docs/spot.md"):
        runtime.resolve_launch(WorldLayout(num_nodes=1, ranks_per_node=2))
    with pytest.raises(ValueError, match=r"spans 2 nodes.*num_nodes=1.*docs/spot.md"):
        runtime.resolve_launch(WorldLayout(num_nodes=2, ranks_per_node=1))
    with pytest.raises(ValueError, match="spans 2 nodes"):
        MatFormerStrategy(settings=_spot(), start_method="spawn").runtime.resolve_launch(WorldLayout(2, 1))


def test_fabric_refuses_the_mode_naming_the_trainer_strategy():
    with pytest.raises(ValueError, match=r"runs in the Trainer only.*lightning_hetero.MatFormerStrategy"):
        FabricMatFormerStrategy(settings=_spot())
