"""Hostile or corrupt replica payloads: rejected with a clear error naming the replica, never applied or crashing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hetero.comm.codecs import pack_indices, pack_values
from lightning_hetero.flexdemo.replicators import build_replicator
from lightning_hetero.flexdemo.replicators.base import PeerPayloadError


def _demo_piece():
    replicator = build_replicator("demo", 1 / 32, chunk=32, values="fp32", index_bits=12)
    piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))
    return replicator, piece


def test_an_out_of_range_coefficient_index_is_refused_naming_the_replica():
    replicator, piece = _demo_piece()
    k = piece.meta["k"]
    indices = torch.full((k,), 4000, dtype=torch.long)  # a 32x32 block has 1024 coefficients; 12 bits reach 4095
    forged = torch.cat([pack_indices(indices, 12), pack_values(torch.ones(1, k), "fp32")])
    with pytest.raises(PeerPayloadError, match="replica 1 sent coefficient index 4000.*1024 coefficients"):
        replicator.decode_gathered(piece, [piece.wire, forged])


@pytest.mark.parametrize(("name", "values"), [("demo", "fp32"), ("topk", "fp32"), ("random", "sign")])
def test_non_finite_values_from_a_peer_are_refused(name, values):
    options = {"chunk": 32} if name in ("demo", "topk") else {}
    replicator = build_replicator(name, 1 / 8, values=values, **options)
    piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(1)))
    forged = piece.wire.clone()
    forged[-4:].view(torch.float32)[0] = float("nan")  # the last fp32 value (sign: the scale) of the payload
    with pytest.raises(PeerPayloadError, match="replica 1 sent non-finite values"):
        replicator.decode_gathered(piece, [piece.wire, forged])


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary())
def test_random_bytes_as_a_peer_payload_never_crash_or_apply_garbage(data):
    replicator, piece = _demo_piece()
    size = piece.wire.numel()
    raw = (data * (size // max(len(data), 1) + 1))[:size] if data else bytes(size)
    forged = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
    try:
        combined = replicator.decode_gathered(piece, [piece.wire, forged])
    except ValueError:
        return  # refused (PeerPayloadError is a ValueError)
    assert combined.shape == piece.shape and bool(torch.isfinite(combined).all())


def test_a_non_finite_all_reduce_is_refused():
    replicator = build_replicator("random", 1 / 8, values="fp32")
    piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(2)))
    summed = piece.wire.clone().float()
    summed[0] = float("inf")
    with pytest.raises(PeerPayloadError, match="all-reduced values for parameter piece 0 are non-finite"):
        replicator.decode_reduced(piece, summed)
