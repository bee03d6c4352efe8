"""Activations from a peer stage are untrusted: crafted headers and payloads are refused before use (one process).

The checks of :class:`~lightning_hetero.layerwise.decoupled.ActivationLink` run on tensors crafted here, as they would
arrive; tests/dist/test_layerwise_payloads.py sends the same kinds of messages over a real gloo link.
"""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.layerwise.decoupled import HEADER_LENGTH, MAX_MESSAGE_ELEMENTS, ActivationLink
from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
from lightning_hetero.strategies.layerwise.fabric import LayerwiseStrategy as FabricLayerwise
from lightning_hetero.strategies.layerwise.trainer import LayerwiseStrategy
from lightning_hetero.subspace.codec import pack_int8


def _header(*values: int) -> torch.Tensor:
    padded = list(values) + [-1] * (HEADER_LENGTH - len(values))
    return torch.tensor(padded, dtype=torch.int64)


def test_a_well_formed_header_is_accepted_and_round_trips_through_send_format() -> None:
    link = ActivationLink(3)
    sent = ActivationLink._header(0, 4, "fp32", (12, 32), torch.device("cpu"))
    assert link.check_header(sent, 4, (12, 32)) == (0, 4, (12, 32))
    assert link.check_header(sent) == (0, 4, (12, 32))  # no local expectation: only bounded


@pytest.mark.parametrize(
    ("header", "batch", "sample", "match"),
    [
        (_header(0, 1, 0, 2, 10**6, 10**6), None, None, "above the"),  # a huge size, nothing local to compare with
        (_header(0, 4, 0, 2, 10**6, 10**6), 4, (12, 32), r"sample shape \(1000000, 1000000\).*expects \(12, 32\)"),
        (_header(0, 4, 0, 2, 12, 31), 4, (12, 32), "expects \\(12, 32\\)"),
        (_header(0, 5, 0, 2, 12, 32), 4, (12, 32), "batch of 5 samples, this stage read 4"),
        (_header(0, 4, 1, 2, 12, 32), 4, (12, 32), "encoded as 'bf16', but this stage decodes 'fp32'"),
        (_header(0, 4, 9, 2, 12, 32), 4, (12, 32), "unknown codec 9"),
        (_header(0, 4, 0, 7, 12, 32), 4, None, "malformed header"),
        (_header(0, 4, 0, 1, 12, 32), 4, None, "malformed header"),  # a size hidden in the padding
        (_header(0, -4, 0, 2, 12, 32), None, None, "non-positive size"),
        (_header(0, 4, 0, 2, 0, 32), None, None, "non-positive size"),
        (torch.zeros(HEADER_LENGTH, dtype=torch.float32), None, None, "not 8 int64"),
        (torch.zeros(HEADER_LENGTH - 1, dtype=torch.int64), None, None, "not 8 int64"),
    ],
)
def test_bad_headers_are_refused_before_anything_is_allocated(header, batch, sample, match) -> None:
    link = ActivationLink(3)
    with pytest.raises(PeerPayloadError, match=f"activations from rank 3 .*{match}") as caught:
        link.check_header(header, batch, sample)
    assert caught.value.peer == 3 and link.last_error is caught.value


def test_the_unchecked_bound_is_what_a_message_may_hold() -> None:
    link = ActivationLink(0)
    link.check_header(_header(0, 1, 0, 1, MAX_MESSAGE_ELEMENTS))
    with pytest.raises(PeerPayloadError, match="above the"):
        link.check_header(_header(0, 2, 0, 1, MAX_MESSAGE_ELEMENTS))


def test_asynchronous_steps_never_go_back_nor_ahead_of_the_message() -> None:
    link = ActivationLink(1, asynchronous=True)
    with pytest.raises(PeerPayloadError, match="announce step 5, but message 0 can only carry steps 0..0"):
        link.check_header(_header(5, 4, 0, 2, 12, 32), 4, (12, 32))
    link.check_header(_header(0, 4, 0, 2, 12, 32), 4, (12, 32))
    link.messages_received = 1
    link.check_header(_header(1, 4, 0, 2, 12, 32), 4, (12, 32))
    link.messages_received = 2
    with pytest.raises(PeerPayloadError, match="announce step 0, but message 2 can only carry steps 1..2"):
        link.check_header(_header(0, 4, 0, 2, 12, 32), 4, (12, 32))
    link.messages_received = 7  # a resume resets the count: the floor restarts too
    link.check_header(_header(3, 4, 0, 2, 12, 32), 4, (12, 32))


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_non_finite_activations_are_refused(codec: str) -> None:
    link = ActivationLink(2, codec=codec)
    good = torch.randn(4, 12, 32).to(link_dtype(codec))
    assert link.check_and_decode(good.clone(), 4, (12, 32), torch.float32).shape == (4, 12, 32)
    for bad in (float("nan"), float("inf")):
        wire = good.clone()
        wire[1, 3, 5] = bad
        with pytest.raises(PeerPayloadError, match="activations from rank 2 holds non-finite"):
            link.check_and_decode(wire, 4, (12, 32), torch.float32)


def link_dtype(codec: str) -> torch.dtype:
    return torch.bfloat16 if codec == "bf16" else torch.float32


def test_an_int8_payload_with_a_bad_scale_is_refused() -> None:
    link = ActivationLink(2, codec="int8")
    wire = pack_int8(torch.randn(4, 12, 32))
    link.check_and_decode(wire.clone(), 4, (12, 32), torch.float32)
    wire[0, 0, -1] = -1.0
    with pytest.raises(PeerPayloadError, match="int8 scale"):
        link.check_and_decode(wire, 4, (12, 32), torch.float32)


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (torch.zeros(4, 12, 31), "came as 1488 torch.float32 values; a batch of 4 x \\(12, 32\\)"),  # wrong length
        (torch.zeros(4 * 12 * 32 + 1), "came as 1537 torch.float32 values"),
        (torch.zeros(4, 12, 32, dtype=torch.bfloat16), "came as 1536 torch.bfloat16 values.*1536 torch.float32"),
    ],
)
def test_a_payload_of_the_wrong_length_or_dtype_is_refused(wire: torch.Tensor, match: str) -> None:
    with pytest.raises(PeerPayloadError, match=match):
        ActivationLink(1).check_and_decode(wire, 4, (12, 32), torch.float32)


def test_drop_needs_asynchronous_mode_and_a_known_policy() -> None:
    with pytest.raises(ValueError, match="on_bad_payload='drop'.*use mode='async'"):
        DecoupledRuntime(2, on_bad_payload="drop")
    with pytest.raises(ValueError, match="on_bad_payload='ignore'"):
        DecoupledRuntime(2, on_bad_payload="ignore")
    with pytest.raises(ValueError, match="on_bad_payload='drop'"):
        ActivationLink(1, on_bad_payload="drop")
    assert ActivationLink(1, asynchronous=True, on_bad_payload="drop").on_bad_payload == "drop"
    assert DecoupledRuntime(2, mode="async", on_bad_payload="drop").on_bad_payload == "drop"


@pytest.mark.parametrize("strategy_class", [LayerwiseStrategy, FabricLayerwise])
def test_the_strategies_hand_the_policy_to_the_runtime(strategy_class: type) -> None:
    assert strategy_class(mode="async", on_bad_payload="drop").runtime.on_bad_payload == "drop"
    assert strategy_class().runtime.on_bad_payload == "raise"
    with pytest.raises(ValueError, match="LayerwiseStrategy\\(on_bad_payload='drop'\\)"):
        strategy_class(on_bad_payload="drop")
