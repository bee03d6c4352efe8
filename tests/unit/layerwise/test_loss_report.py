"""The last stage's loss on rank 0 (:class:`ModelLossReport`): what rank 0 accepts from the last stage.

The exchange itself runs in ``tests/usercode/test_layerwise_user.py`` (2 spawned ranks, rank 0's progress bar).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.layerwise.loss_report import ModelLossReport
from tests.payload_rule import assert_decoder_rule


def _receiver(received: int = 0) -> ModelLossReport:
    report = ModelLossReport("receive", 1, torch.device("cpu"), lag=3, window=8)
    report.reset(received)
    return report


def test_messages_in_order_update_the_value() -> None:
    report = _receiver()
    report.accept(torch.tensor([2.5, 0.0], dtype=torch.float64))
    report.accept(torch.tensor([2.25, 1.0], dtype=torch.float64))
    assert (report.value, report.step, report.received) == (2.25, 1, 2)


@pytest.mark.parametrize(
    "message, field",
    [
        ([float("nan"), 0.0], "model_loss"),
        ([float("inf"), 0.0], "model_loss"),
        ([2.0**70, 0.0], "model_loss"),
        ([1.0, 1.0], "model_loss.step"),  # skips step 0
        ([1.0, 0.5], "model_loss.step"),  # not a step
        ([1.0, -1.0], "model_loss.step"),
    ],
)
def test_bad_messages_are_refused_naming_the_peer_and_field(message: list[float], field: str) -> None:
    report = _receiver()
    with pytest.raises(PeerPayloadError) as caught:
        report.accept(torch.tensor(message, dtype=torch.float64))
    assert (caught.value.peer, caught.value.field) == (1, field)
    assert report.value is None and report.received == 0  # nothing taken from a refused message


@settings(max_examples=200, deadline=None)
@given(st.floats(), st.one_of(st.floats(), st.integers(-2, 8).map(float)), st.integers(0, 5))
def test_decoder_rule(loss: float, step: float, received: int) -> None:
    report = _receiver(received)

    def decode() -> torch.Tensor:
        report.accept(torch.tensor([loss, step], dtype=torch.float64))
        assert report.step == received
        return torch.tensor([report.value], dtype=torch.float64)

    assert_decoder_rule(decode, peer=1)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="role"):
        ModelLossReport("both", 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="window"):
        ModelLossReport("send", 1, torch.device("cpu"), lag=1, window=0)
