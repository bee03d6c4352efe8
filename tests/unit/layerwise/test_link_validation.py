"""Activations from a peer stage are untrusted: crafted headers and payloads are refused before use (one process).

The checks of :class:`~lightning_hetero.layerwise.decoupled.ActivationLink` run on tensors crafted here, as they would
arrive; tests/dist/test_layerwise_payloads.py sends the same kinds of messages over a real gloo link.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.layerwise.decoupled import HEADER_LENGTH, MAX_MESSAGE_ELEMENTS, ActivationLink
from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
from lightning_hetero.layerwise.settings import LayerwiseSettings
from lightning_hetero.pipeline.boundary_codec import BoundaryCodec, pack_int8
from lightning_hetero.strategies.layerwise.fabric import LayerwiseStrategy as FabricLayerwise
from lightning_hetero.strategies.layerwise.trainer import LayerwiseStrategy
from tests.payload_rule import assert_decoder_rule


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
    with pytest.raises(ValueError, match="on_bad_payload='drop' with LayerwiseSettings.mode='sync'.*use mode='async'"):
        LayerwiseSettings(on_bad_payload="drop")
    with pytest.raises(ValueError, match="on_bad_payload='ignore'"):
        LayerwiseSettings(on_bad_payload="ignore")
    with pytest.raises(ValueError, match="on_bad_payload='drop'"):
        ActivationLink(1, on_bad_payload="drop")
    assert ActivationLink(1, asynchronous=True, on_bad_payload="drop").on_bad_payload == "drop"
    runtime = DecoupledRuntime(LayerwiseSettings(mode="async", on_bad_payload="drop"))  # accepted asynchronously
    assert runtime.settings.on_bad_payload == "drop"


@pytest.mark.parametrize("strategy_class", [LayerwiseStrategy, FabricLayerwise])
def test_the_strategies_hand_the_policy_to_the_runtime(strategy_class: type) -> None:
    settings = LayerwiseSettings(mode="async", on_bad_payload="drop")
    assert strategy_class(settings=settings).runtime.settings.on_bad_payload == "drop"
    assert strategy_class().runtime.settings.on_bad_payload == "raise"


# ------------------------------------------------------------------------------------------------ announced sizes
def test_a_header_without_a_local_expectation_is_bounded_by_the_layouts_this_stage_knows() -> None:
    """A stale message (its batch no longer kept) used to be bounded only by 2**30 elements: 4 GiB of fp32."""
    link = ActivationLink(3)
    link.check_header(_header(0, 4, 0, 2, 12, 32), 4, (12, 32))  # a batch this stage read: (4, (12, 32))
    for header, field in [
        (_header(0, 1, 0, 1, 2**30 - 1), "header.ndim"),  # fits the old bound, not this stage's 2-D layout
        (_header(0, 4, 0, 2, 12, 32 * 1024), "header.sample[1]"),
        (_header(0, 4, 0, 2, 2**20, 32), "header.sample[0]"),
        (_header(0, 5, 0, 2, 12, 32), "header.batch"),
    ]:
        with pytest.raises(PeerPayloadError, match="activations from rank 3 .*this stage's own layout") as caught:
            link.check_header(header)
        assert (caught.value.peer, caught.value.field) == (3, field) and link.last_error is caught.value
    assert link.check_header(_header(0, 2, 0, 2, 7, 32)) == (0, 2, (7, 32))  # smaller: an older, shorter batch


def test_a_known_batch_alone_still_bounds_the_sample_shape() -> None:
    link = ActivationLink(3)
    link.allow_layout(4, (12, 32))
    with pytest.raises(PeerPayloadError, match="header.sample") as caught:
        link.check_header(_header(0, 4, 0, 2, 12, 64), 4)
    assert caught.value.field == "header.sample[1]"
    assert link.check_header(_header(0, 4, 0, 2, 12, 32), 4) == (0, 4, (12, 32))


def test_header_errors_name_their_field() -> None:
    cases = [
        (torch.zeros(HEADER_LENGTH - 1, dtype=torch.int64), None, None, "header"),
        (_header(0, 4, 1, 2, 12, 32), 4, (12, 32), "header.codec"),
        (_header(0, 4, 0, 7, 12, 32), 4, None, "header.ndim"),
        (_header(0, -4, 0, 2, 12, 32), None, None, "header.batch"),
        (_header(0, 4, 0, 2, 0, 32), None, None, "header.sample"),
        (_header(0, 5, 0, 2, 12, 32), 4, (12, 32), "header.batch"),
        (_header(0, 4, 0, 2, 12, 31), 4, (12, 32), "header.sample"),
    ]
    for header, batch, sample, field in cases:
        with pytest.raises(PeerPayloadError) as caught:
            ActivationLink(3).check_header(header, batch, sample)
        assert (caught.value.peer, caught.value.field) == (3, field), str(caught.value)
    with pytest.raises(PeerPayloadError) as caught:
        ActivationLink(1, asynchronous=True).check_header(_header(5, 4, 0, 2, 12, 32), 4, (12, 32))
    assert caught.value.field == "header.step"


# ------------------------------------------------------------------------------------------------ the decoder rule
FUZZ = settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(
    values=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-2, 70), min_size=HEADER_LENGTH, max_size=8),
    known=st.booleans(),
    asynchronous=st.booleans(),
)
def test_random_headers_keep_the_rule(values: list[int], known: bool, asynchronous: bool) -> None:
    link = ActivationLink(2, asynchronous=asynchronous)
    link.allow_layout(4, (12, 32))
    header = torch.tensor(values, dtype=torch.int64)

    def check(result: tuple[int, int, tuple[int, ...]]) -> None:
        _, batch, sample = result
        assert 1 <= batch <= 4 and len(sample) == 2 and sample[0] <= 12 and sample[1] <= 32

    assert_decoder_rule(
        lambda: link.check_header(header, *((4, (12, 32)) if known else ())), peer=2, check_layout=check
    )


@FUZZ
@given(
    codec=st.sampled_from(["fp32", "bf16", "int8"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    position=st.integers(0, 10**6),
    value=st.floats(width=32) | st.sampled_from([3e38, 2.0**65, 1e6, -128.0]),
    byte=st.integers(-128, 127) | st.none(),
)
def test_a_payload_with_one_value_corrupted_keeps_the_rule(codec, dtype, position, value, byte) -> None:
    link = ActivationLink(2, codec=codec)
    wire = BoundaryCodec(codec, 32).encode(torch.randn(2, 3, 32)).contiguous()
    flat = wire.reshape(-1)
    if byte is not None and codec == "int8":
        flat.view(torch.int8)[position % (flat.numel() * 4)] = byte
    else:
        flat[position % flat.numel()] = value

    def check(result: torch.Tensor) -> None:
        assert result.shape == (2, 3, 32) and result.dtype == dtype

    assert_decoder_rule(lambda: link.check_and_decode(wire, 2, (3, 32), dtype), peer=2, check_layout=check)


@FUZZ
@given(data=st.binary(min_size=0, max_size=2 * 3 * 9 * 4 + 8), codec=st.sampled_from(["fp32", "bf16", "int8"]))
def test_random_payload_bytes_keep_the_rule(data: bytes, codec: str) -> None:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    wire_dtype = BoundaryCodec(codec, 32).wire_dtype
    usable = raw[: raw.numel() // wire_dtype.itemsize * wire_dtype.itemsize].clone()
    wire = usable.view(wire_dtype)
    assert_decoder_rule(
        lambda: ActivationLink(2, codec=codec).check_and_decode(wire, 2, (3, 32), torch.float32), peer=2
    )
