"""Boundary tensors from a neighbour stage: NaN/Inf or a bad int8 scale is refused before it is decoded."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.subspace.codec import BoundaryCodec, pack_int8
from lightning_hetero.subspace.pipeline import BACKWARD_TAG, FORWARD_TAG, PipelineExecutor
from lightning_hetero.subspace.runtime import SubspacePipelineRuntime

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
        SubspacePipelineRuntime(num_stages=2, on_bad_payload="drop")
    with pytest.raises(ValueError, match="on_bad_payload='ignore'"):
        SubspacePipelineRuntime(num_stages=2, on_bad_payload="ignore")
