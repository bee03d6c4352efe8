"""Boundary tensors from a neighbour stage: NaN/Inf or a bad int8 scale is refused before it is decoded."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError
from lightning_hetero.pipeline.boundary_codec import BoundaryCodec, pack_int8
from lightning_hetero.subspace_pipeline.pipeline import BACKWARD_TAG, FORWARD_TAG, PipelineExecutor
from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings
from tests.payload_rule import assert_decoder_rule

FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("coord_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_float_boundaries_are_refused(coord_dtype, bad):
    codec = BoundaryCodec(coord_dtype, 8)
    wire = codec.encode(torch.randn(2, 3, 8))
    codec.check_wire(wire, peer=1)
    wire[1, 2, 5] = bad
    with pytest.raises(PeerPayloadError, match="boundary tensor from rank 1 holds non-finite"):
        codec.check_wire(wire, peer=1)


def test_int8_payload_bits_may_look_like_nan_but_the_scale_may_not():
    codec = BoundaryCodec("int8", 8)
    values = torch.full((1, 2, 8), -1.0)
    values[..., :4] = torch.tensor([0.0, 0.0, -64.0 / 127, 1.0])  # int8 bytes 00 00 C0 7F: a NaN float32 slot
    wire = pack_int8(values)
    assert bool(torch.isnan(wire[..., :-1]).any())  # the container's payload is raw bits, NaN pattern included
    codec.check_wire(wire, peer=0)
    for bad in (float("nan"), float("inf"), -1.0):
        forged = wire.clone()
        forged[0, 1, -1] = bad
        with pytest.raises(PeerPayloadError, match="negative, non-finite or overflowing int8 scale"):
            codec.check_wire(forged, peer=0)


def test_a_boundary_of_the_wrong_width_or_dtype_is_refused():
    codec = BoundaryCodec("fp32", 8)
    with pytest.raises(PeerPayloadError, match="last dimension 8 and torch.float32"):
        codec.check_wire(torch.zeros(2, 3, 7), peer=2)
    with pytest.raises(PeerPayloadError, match="last dimension 8 and torch.float32"):
        codec.check_wire(torch.zeros(2, 3, 8, dtype=torch.bfloat16), peer=2)


@FUZZ
@given(st.binary(min_size=12 * 4, max_size=12 * 4))
def test_random_int8_containers_are_refused_or_decode_to_finite_values(data):
    codec = BoundaryCodec("int8", 8)
    wire = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(1, 4, 3).clone()
    try:
        codec.check_wire(wire, peer=1)
    except PeerPayloadError:
        return
    assert bool(torch.isfinite(codec.decode(wire, torch.float32)).all())


class _StageWithoutCodec(nn.Module):
    """What the executor needs of a stage that has no BoundaryCodec (a plain float boundary)."""

    is_first, is_last = False, False


@pytest.mark.parametrize(("tag", "what"), [(FORWARD_TAG, "activations"), (BACKWARD_TAG, "gradients")])
def test_the_executor_checks_what_it_receives_from_each_direction(tag, what):
    executor = PipelineExecutor.__new__(PipelineExecutor)  # only the receive check, no process group
    executor.stage = _StageWithoutCodec()
    executor._check_received(torch.ones(2, 3), 1, tag)
    with pytest.raises(PeerPayloadError, match=f"boundary {what} from rank 1 holds non-finite"):
        executor._check_received(torch.tensor([[1.0, float("-inf")]]), 1, tag)


def test_drop_is_refused_for_the_pipeline_with_the_reason():
    with pytest.raises(ValueError, match="on_bad_payload='drop'.*cannot be dropped; use on_bad_payload='raise'"):
        SubspacePipelineSettings(on_bad_payload="drop")
    with pytest.raises(ValueError, match="on_bad_payload='ignore'"):
        SubspacePipelineSettings(on_bad_payload="ignore")


# ------------------------------------------------------------------------------------------------ the decoder rule
def _receive(codec: BoundaryCodec, wire: torch.Tensor, dtype: torch.dtype = torch.float32, peer: int = 1):
    """What a receiving stage does: check the wire tensor, then decode it."""
    return codec.decode_received(wire, dtype, peer=peer, what="boundary activations")


def _int8_wire(rows: int = 2, width: int = 8) -> torch.Tensor:
    return pack_int8(torch.randn(1, rows, width, generator=torch.Generator().manual_seed(rows)))


def _set_byte(wire: torch.Tensor, token: int, position: int, value: int) -> torch.Tensor:
    forged = wire.clone()
    payload = forged[0, token, :-1].view(torch.int8)  # a view: writes go into the container's bits
    payload[position] = value
    return forged


def test_a_minus_128_byte_is_refused_even_with_a_scale_the_encoder_could_send():
    """-128 (never encoded) times a scale just under max / 127 used to decode to -Inf."""
    codec = BoundaryCodec("int8", 8)
    wire = _set_byte(_int8_wire(), 1, 3, -128)
    wire[0, 1, -1] = torch.finfo(torch.float32).max / 127 * 0.9999
    with pytest.raises(PeerPayloadError, match="-128") as caught:
        codec.check_wire(wire, peer=1)
    assert (caught.value.peer, caught.value.field) == (1, "payload")
    wire[0, 1, -1] = 1.0  # a small scale: still refused, the byte itself is outside the codec
    with pytest.raises(PeerPayloadError, match="-128"):
        _receive(codec, wire)


def test_an_int8_scale_that_decodes_above_the_magnitude_bound_is_refused():
    codec = BoundaryCodec("int8", 8)
    wire = _int8_wire()
    wire[0, 0, -1] = MAX_PEER_MAGNITUDE / 127 * 1.01  # finite, below max / 127, but 127 * scale > 2**64
    with pytest.raises(PeerPayloadError, match="int8 scale") as caught:
        codec.check_wire(wire, peer=2)
    assert (caught.value.peer, caught.value.field) == (2, "scale")
    wire[0, 0, -1] = MAX_PEER_MAGNITUDE / 127  # the largest scale whose values stay within the bound
    assert float(_receive(codec, wire).abs().max()) <= MAX_PEER_MAGNITUDE


def test_non_zero_int8_padding_is_refused():
    codec = BoundaryCodec("int8", 6)  # 6 bytes padded to 8
    wire = _set_byte(pack_int8(torch.randn(1, 2, 6)), 0, 7, 5)
    with pytest.raises(PeerPayloadError, match="padding") as caught:
        codec.check_wire(wire, peer=0)
    assert caught.value.field == "payload"


@pytest.mark.parametrize("coord_dtype", ["fp32", "bf16"])
def test_a_finite_float_boundary_above_the_magnitude_bound_is_refused(coord_dtype):
    codec = BoundaryCodec(coord_dtype, 8)
    wire = codec.encode(torch.randn(2, 3, 8))
    wire[0, 1, 2] = 1e30
    with pytest.raises(PeerPayloadError, match="magnitude") as caught:
        codec.check_wire(wire, peer=3)
    assert (caught.value.peer, caught.value.field) == (3, "values")


@pytest.mark.parametrize("coord_dtype", ["fp32", "bf16", "int8"])
def test_values_that_overflow_the_receivers_dtype_are_refused(coord_dtype):
    """A bf16/fp32 value of 1e6 is finite on the wire but Inf once cast to a float16 stage."""
    codec = BoundaryCodec(coord_dtype, 8)
    values = torch.randn(1, 2, 8)
    values[0, 0, 0] = 1e6
    wire = codec.encode(values)
    assert bool(torch.isfinite(codec.decode(wire, torch.float32)).all())
    with pytest.raises(PeerPayloadError, match="float16") as caught:
        _receive(codec, wire, torch.float16)
    assert caught.value.peer == 1
    assert bool(torch.isfinite(_receive(codec, codec.encode(torch.randn(1, 2, 8)), torch.float16)).all())


def _layout(width: int, dtype: torch.dtype):
    def check(result: torch.Tensor) -> None:
        assert result.shape[-1] == width and result.dtype == dtype

    return check


@FUZZ
@given(
    data=st.binary(min_size=12 * 4, max_size=12 * 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_random_int8_containers_keep_the_decoder_rule(data, dtype):
    codec = BoundaryCodec("int8", 8)
    wire = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(1, 4, 3).clone()
    assert_decoder_rule(lambda: _receive(codec, wire, dtype), peer=1, check_layout=_layout(8, dtype))


@FUZZ
@given(
    token=st.integers(0, 1),
    position=st.integers(0, 7),
    byte=st.sampled_from([-128, -127, 127, 0]) | st.integers(-128, 127),
    scale=st.none()
    | st.sampled_from([torch.finfo(torch.float32).max / 127 * 0.9999, MAX_PEER_MAGNITUDE / 127, 3e38])
    | st.floats(width=32),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_a_valid_int8_container_with_one_field_corrupted_keeps_the_decoder_rule(token, position, byte, scale, dtype):
    codec = BoundaryCodec("int8", 8)
    wire = _set_byte(_int8_wire(), token, position, byte)
    if scale is not None:
        wire[0, token, -1] = scale
    assert_decoder_rule(lambda: _receive(codec, wire, dtype), peer=1, check_layout=_layout(8, dtype))


@FUZZ
@given(
    coord_dtype=st.sampled_from(["fp32", "bf16"]),
    value=st.floats(width=32) | st.sampled_from([3e38, -3e38, 2.0**64, 2.0**65, 65504.0, 65536.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_a_float_boundary_with_one_value_corrupted_keeps_the_decoder_rule(coord_dtype, value, dtype):
    codec = BoundaryCodec(coord_dtype, 8)
    wire = codec.encode(torch.randn(1, 2, 8))
    wire[0, 1, 4] = value
    assert_decoder_rule(lambda: _receive(codec, wire, dtype), peer=1, check_layout=_layout(8, dtype))


class _Float16Stage(nn.Module):
    """A stage with a bf16 boundary codec that computes in float16."""

    is_first, is_last = False, False
    codec = BoundaryCodec("bf16", 8)
    compute_dtype = torch.float16


@pytest.mark.parametrize(("tag", "what"), [(FORWARD_TAG, "activations"), (BACKWARD_TAG, "gradients")])
def test_the_executor_bounds_what_it_receives_by_the_stage_dtype_and_the_peer_bound(tag, what):
    executor = PipelineExecutor.__new__(PipelineExecutor)
    executor.stage = _Float16Stage()
    executor._check_received(torch.ones(2, 3, 8, dtype=torch.bfloat16), 1, tag)
    with pytest.raises(PeerPayloadError, match=f"boundary {what} from rank 1 .*float16") as caught:
        executor._check_received(torch.full((2, 3, 8), 1e6, dtype=torch.bfloat16), 1, tag)
    assert caught.value.field == "values"
    executor.stage = _StageWithoutCodec()
    with pytest.raises(PeerPayloadError, match=f"boundary {what} from rank 1 holds a value of magnitude 1e\\+30"):
        executor._check_received(torch.tensor([[1.0, 1e30]]), 1, tag)
