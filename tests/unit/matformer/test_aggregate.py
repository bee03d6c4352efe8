"""aggregate_gradients in one process (a world of one): results, and clear errors for bad input."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.comm import ByteLedger, get_ledger
from lightning_hetero.matformer.aggregate import aggregate_gradients
from lightning_hetero.matformer.compressed import CompressedExchange
from lightning_hetero.matformer.helper_ranks import HelperConfig
from lightning_hetero.matformer.layout import widths_for
from lightning_hetero.matformer.region_groups import RegionGroups
from lightning_hetero.matformer.types import FFNParameter

UP = FFNParameter("up", 0, 8, 0)


def _grads(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    up = torch.tensor([[1.5], [-2.0], [0.0], [3.0], [0.0], [1.0], [-1.0], [2.0]], device=device)
    return {"up": up, "norm": torch.zeros(2, device=device)}


def test_world_of_one_mean_is_identity_and_sign_keeps_zeros(device: torch.device) -> None:
    groups, ledger = RegionGroups(widths_for([0], 8)), ByteLedger()
    grads = _grads(device)
    aggregate_gradients(grads, [UP], groups, ledger=ledger)
    assert torch.equal(grads["up"], _grads(device)["up"]) and ledger.totals().calls == 0  # nothing to exchange
    aggregate_gradients(grads, [UP], groups, "sign", tier_weights={0: 3.0})
    assert grads["up"].device == device
    assert grads["up"].flatten().tolist() == [1, -1, 0, 1, 0, 1, -1, 1] and grads["norm"].tolist() == [0, 0]


def test_bad_modes() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate_gradients(_grads(), [UP], widths_for([0], 8), "avg")


def test_demo_in_a_world_of_one_is_exact_and_keeps_no_state(device: torch.device) -> None:
    groups = RegionGroups(widths_for([0], 8))
    exchange = CompressedExchange(groups, 1 / 8)
    grads = _grads(device)
    with get_ledger().capture() as seen:
        aggregate_gradients(grads, [UP], groups, "demo", exchange=exchange)
    assert torch.equal(grads["up"], _grads(device)["up"]) and seen.totals().calls == 0  # a single member: nothing sent
    assert exchange.errors == {} and exchange.replicators == {}


def test_demo_errors_name_the_fix() -> None:
    groups = RegionGroups(widths_for([0], 8))
    with pytest.raises(ValueError, match=r"mode='demo' needs exchange=CompressedExchange"):
        aggregate_gradients(_grads(), [UP], groups, "demo")
    with pytest.raises(ValueError, match="built on other RegionGroups"):
        aggregate_gradients(_grads(), [UP], widths_for([0], 8), "demo", exchange=CompressedExchange(groups))
    with pytest.raises(ValueError, match="exchange= is only used by mode='demo'"):
        aggregate_gradients(_grads(), [UP], groups, "mean", exchange=CompressedExchange(groups))
    with pytest.raises(ValueError, match=r"drop label=/ledger= and use comm.get_ledger\(\).capture"):
        aggregate_gradients(_grads(), [UP], groups, "demo", ledger=ByteLedger(), exchange=CompressedExchange(groups))
    with pytest.raises(ValueError, match=r"ReplicationSettings.kept_fraction=0.0: use a fraction in \(0, 1\]"):
        CompressedExchange(groups, 0.0)
    with pytest.raises(ValueError, match=r"ReplicationSettings.chunk=0"):
        CompressedExchange(groups, 0.5, chunk=0)


@pytest.mark.parametrize(
    ("grads", "ffn", "match"),
    [
        ({"norm": torch.zeros(2)}, [UP], r"grads lacks FFN parameters \['up'\]; pass zeros"),
        ({"up": torch.zeros(8, 1, dtype=torch.int64)}, [UP], r"grads\['up'\] must be a floating-point tensor"),
        ({"up": torch.zeros(6, 1)}, [UP], r"has size 6 on axis 0; rank 0 holds 8 neurons"),
        ({"up": torch.zeros(8, 1)}, [UP, UP], "lists a parameter twice"),
        ({"up": torch.zeros(8, 1)}, [FFNParameter("up", 0, 16, 0)], "full_size 16 != the layout's 8"),
        ({"up": torch.zeros(8)}, [FFNParameter("up", 1, 8, 0)], "axis 1 is out of range"),
    ],
)
def test_bad_gradients_are_named(grads: dict, ffn: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        aggregate_gradients(grads, ffn, widths_for([0], 8))


def test_layout_and_helper_mismatches() -> None:
    with pytest.raises(ValueError, match="layout describes 2 ranks but the world has 1"):
        RegionGroups(widths_for([0, 1], 8))
    with pytest.raises(ValueError, match="must be a TierLayout or RegionGroups"):
        aggregate_gradients(_grads(), [UP], [0])  # type: ignore[arg-type]
    # A helper in a world of one is meaningless but valid when its layout allows it; the check is on step.
    groups = RegionGroups(widths_for([1], 8), helpers={0: HelperConfig(0.5)})
    with pytest.raises(ValueError, match="needs step="):
        aggregate_gradients({"up": torch.zeros(6, 1)}, [UP], groups)
    with pytest.raises(ValueError, match="helpers differ"):
        aggregate_gradients({"up": torch.zeros(6, 1)}, [UP], groups, helpers={0: HelperConfig(0.25)}, step=0)
    grads = {"up": torch.ones(6, 1)}  # width 4 + 2 drawn tail neurons
    aggregate_gradients(grads, [UP], groups, step=3)
    assert grads["up"].flatten().tolist() == [1.0] * 6
