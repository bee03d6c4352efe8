"""Boundary codec: round-trip error bounds, bytes on the wire, and the dtype/shape of the backward message."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hetero.pipeline.boundary_codec import BoundaryCodec, pack_int8, unpack_int8
from lightning_hetero.subspace_pipeline import SubspaceConfig, build_stages
from tests.unit.subspace_pipeline._tiny import chain_with_messages, fresh, relative_error, tiny_model, token_ids

B, S = 3, 5


def _values(width: int, device: torch.device | None = None) -> torch.Tensor:
    values = torch.randn(B, S, width, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 10, S)[:, None]
    return values.to(device)


@pytest.mark.parametrize("width", [8, 10])
def test_bytes_and_shapes(width: int, device: torch.device) -> None:
    assert BoundaryCodec("fp32", width).wire_bytes(B, S) == B * S * width * 4
    assert BoundaryCodec("bf16", width).wire_bytes(B, S) == B * S * width * 2
    int8 = BoundaryCodec("int8", width)
    assert int8.wire_bytes(B, S) == B * S * (4 * math.ceil(width / 4) + 4)  # int8 payload (padded) + fp32 scale
    for name in ("fp32", "bf16", "int8"):
        codec = BoundaryCodec(name, width)
        wire = codec.encode(_values(width, device))
        assert wire.shape == codec.wire_shape(B, S) and wire.dtype == codec.wire_dtype and wire.device == device
        assert wire.numel() * wire.element_size() == codec.wire_bytes(B, S)


@pytest.mark.parametrize("width", [8, 10])
def test_round_trip_error_bounds(width: int, device: torch.device) -> None:
    values = _values(width, device)
    assert torch.equal(
        BoundaryCodec("fp32", width).decode(BoundaryCodec("fp32", width).encode(values), torch.float32), values
    )
    bf16 = BoundaryCodec("bf16", width)
    error = (bf16.decode(bf16.encode(values), torch.float32) - values).abs()
    assert (error <= values.abs() * 2**-8).all()  # round-to-nearest with 8 significant bits
    int8 = BoundaryCodec("int8", width)
    decoded = int8.decode(int8.encode(values), torch.float32)
    step = values.abs().amax(dim=-1, keepdim=True) / 127
    assert ((decoded - values).abs() <= step / 2 + 1e-7).all()  # half a quantisation step per token
    assert (decoded - values).abs().max() > 0  # it is lossy


def test_int8_packing_survives_nan_bit_patterns_and_zeros(device: torch.device) -> None:
    values = torch.zeros(2, 4, 8, device=device)
    values[0, 0] = torch.tensor(
        [127.0, 127, 127, 127, -1, -1, -1, -1], device=device
    )  # bytes 0x7f7f7f7f / 0xffffffff (NaN bits)
    container = pack_int8(values)
    assert torch.isnan(container).any()
    assert torch.equal(unpack_int8(container.clone(), 8), values)


@pytest.mark.parametrize("coord_dtype", ["bf16", "int8"])
def test_backward_message_has_the_wire_shape_and_dtype(coord_dtype: str) -> None:
    model = tiny_model()
    stages = build_stages(fresh(model), SubspaceConfig(subspace_dim=8, coord_dtype=coord_dtype), 2, [0, 1])
    exact = build_stages(fresh(model), SubspaceConfig(subspace_dim=8), 2, [0, 1])
    ids = token_ids()
    logits, _, received = chain_with_messages(stages, ids)
    exact_logits, _, exact_received = chain_with_messages(exact, ids)
    (message,) = received
    codec = stages[0].codec
    assert message.grad.shape == codec.wire_shape(2, 12) and message.grad.dtype == codec.wire_dtype
    # lossy but close: the decoded message approximates the exact k-dim gradient
    decoded = message.grad.float() if coord_dtype == "bf16" else unpack_int8(message.grad, 8)
    assert relative_error(decoded, exact_received[0].grad) < 0.05
    assert relative_error(logits, exact_logits) < 0.05
    assert stages[0].boundary_bytes(2, 12) == codec.wire_bytes(2, 12)


def test_uncompressed_int8_is_the_int8_activation_baseline() -> None:
    stage = build_stages(tiny_model(), SubspaceConfig(compress=False, coord_dtype="int8"), 2, [0])[0]
    assert stage.boundary_shape(2, 12) == (2, 12, 64 // 4 + 1)
    assert stage(None, token_ids()).shape == (2, 12, 17)
