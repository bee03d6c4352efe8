"""Nothing applied unchecked: the combined update (finite, bounded, the outlier rule) and a recovered state validated
whole against the joiner's own configuration, before any of it is applied."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.ft.checks import combine_contributions, validate_recovered


def _slots(*scales: float) -> list[torch.Tensor]:
    base = torch.linspace(-1, 1, 16)
    return [base * scale for scale in scales]


def test_an_honest_combination_is_the_sum_in_slot_order():
    slots = _slots(1.0, 2.0, 3.0)
    combined = combine_contributions(slots, outlier_factor=10)
    assert combined.kept == [0, 1, 2] and combined.refused == {}
    assert torch.equal(combined.total, slots[0] + slots[1] + slots[2])


def test_non_finite_and_huge_contributions_are_left_out_naming_the_slot():
    slots = _slots(1.0, 1.0, 1.0)
    slots[1][3] = float("nan")
    slots[2][0] = 3e38
    combined = combine_contributions(slots, outlier_factor=0, names=["a", "b", "c"])
    assert combined.kept == [0] and torch.equal(combined.total, slots[0])
    assert "b holds NaN/Inf" in combined.refused[1] and "c holds a value of magnitude" in combined.refused[2]


def test_the_outlier_rule_drops_a_single_outlier_from_three_or_more():
    slots = _slots(1.0, 1.2, 0.9, 50.0)
    combined = combine_contributions(slots, outlier_factor=10)
    assert combined.kept == [0, 1, 2] and "outlier rule" in combined.refused[3]
    assert torch.equal(combined.total, slots[0] + slots[1] + slots[2])
    assert combine_contributions(slots, outlier_factor=0).kept == [0, 1, 2, 3]  # off
    assert combine_contributions(_slots(1.0, 50.0), outlier_factor=10).kept == [0, 1]  # 2: the median is the mean
    assert combine_contributions(_slots(0.0, 0.0, 5.0), outlier_factor=10).kept == [0, 1, 2]  # median 0: no rule


def test_nothing_usable_or_an_overflowing_sum_raises():
    slots = _slots(1.0, 1.0)
    for slot in slots:
        slot[0] = float("inf")
    with pytest.raises(PeerPayloadError, match="no contribution is usable"):
        combine_contributions(slots, outlier_factor=10)
    big = [torch.full((4,), 1.6e19) for _ in range(2)]  # each within 2**64, the sum is not
    with pytest.raises(PeerPayloadError, match="above the bound"):
        combine_contributions(big, outlier_factor=0)


# ------------------------------------------------------------------------------------------------ recovery
def _own(lr: float = 0.02, scheduler: bool = False) -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if scheduler:
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(4, 3)).square().mean().backward()
    optimizer.step()
    state = {
        "user": {
            "default": {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "extra": {},
            }
        },
        "torchft": {"step": 5, "batches_committed": 10},
    }
    return state, model, optimizer


def _forge(edit) -> dict[str, Any]:
    own, _, _ = _own()
    forged = copy.deepcopy(own)
    edit(forged)
    return forged


def _optim(state: dict[str, Any]) -> dict[str, Any]:
    return state["user"]["default"]["optimizer"]


FORGERIES = {
    "Adam exp_avg_sq = -1": (
        lambda s: _optim(s)["state"][0]["exp_avg_sq"].fill_(-1.0),
        "user/default/optimizer/state/0/exp_avg_sq",
    ),
    "lr = 1e18": (lambda s: _optim(s)["param_groups"][0].update(lr=1e18), "user/default/optimizer/param_groups/0/lr"),
    "betas = (5, -3)": (
        lambda s: _optim(s)["param_groups"][0].update(betas=(5.0, -3.0)),
        "user/default/optimizer/param_groups/0/betas",
    ),
    "eps changed": (
        lambda s: _optim(s)["param_groups"][0].update(eps=1.0),
        "user/default/optimizer/param_groups/0/eps",
    ),
    "weight_decay changed": (
        lambda s: _optim(s)["param_groups"][0].update(weight_decay=-5.0),
        "user/default/optimizer/param_groups/0/weight_decay",
    ),
    "params permuted": (
        lambda s: _optim(s)["param_groups"][0].update(params=[1, 0]),
        "user/default/optimizer/param_groups/0/params",
    ),
    "negative Adam step": (
        lambda s: _optim(s)["state"][0]["step"].fill_(-3.0),
        "user/default/optimizer/state/0/step",
    ),
    "fractional Adam step": (
        lambda s: _optim(s)["state"][1]["step"].fill_(2.5),
        "user/default/optimizer/state/1/step",
    ),
    "torchft step 2**63 - 1": (lambda s: s["torchft"].update(step=2**63 - 1), "torchft/step"),
    "torchft step of another quorum": (lambda s: s["torchft"].update(step=4), "torchft/step"),
    "negative batches_committed": (lambda s: s["torchft"].update(batches_committed=-1), "torchft/batches_committed"),
    "invalid torch RNG state": (
        lambda s: s["user"]["default"]["rng"]["torch"].zero_(),
        "user/default/rng",
    ),
    "invalid python RNG state": (
        lambda s: s["user"]["default"]["rng"].update(python=(3, tuple([2**40] * 625), None)),
        "user/default/rng",
    ),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_forged_recovery_state_is_refused_naming_the_field(name):
    edit, field = FORGERIES[name]
    own, _, _ = _own()
    with pytest.raises(PeerPayloadError, match="recovery checkpoint from replica 2") as caught:
        validate_recovered(_forge(edit), own, step=5, peer=2)
    assert (caught.value.peer, caught.value.field) == (2, field)


def test_an_honest_state_and_a_scheduled_lr_are_accepted():
    own, _, _ = _own()
    validate_recovered(copy.deepcopy(own), own, step=5, peer=1)
    scheduled, _, optimizer = _own(scheduler=True)
    peer = copy.deepcopy(scheduled)
    _optim(peer)["param_groups"][0]["lr"] = 0.02 * 0.5**7  # a later point of the joiner's own schedule
    validate_recovered(peer, scheduled, step=5, peer=1)
    _optim(peer)["param_groups"][0]["lr"] = 1e18
    with pytest.raises(PeerPayloadError, match="outside"):
        validate_recovered(peer, scheduled, step=5, peer=1)


def test_rng_states_are_tried_on_copies_never_the_live_generator():
    own, _, _ = _own()
    live = torch.get_rng_state()
    forged = copy.deepcopy(own)
    forged["user"]["default"]["rng"]["torch"] = torch.roll(own["user"]["default"]["rng"]["torch"], 7)
    try:
        validate_recovered(forged, own, step=5, peer=1)
    except PeerPayloadError:
        pass
    assert torch.equal(torch.get_rng_state(), live)
