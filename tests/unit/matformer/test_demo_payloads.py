"""``mode="demo"``: a member's DeMo payload that decodes to Inf, or holds an invalid code, never reaches a gradient.

The bucket decode is the FlexDeMo replicator's (``CompressedExchange`` holds one per rank set); here three members
are simulated in one process by handing :meth:`CompressedExchange.finish` a completed gathered bucket holding this
rank's bytes and two peers' bytes (the collective itself runs in ``tests/dist/test_matformer_compressed.py``).
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from lightning_hetero.comm.payload_packing import pack_indices, pack_values
from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.matformer.compressed import CompressedExchange, _Launched, build_demo_replicator
from lightning_hetero.matformer.layout import widths_for
from lightning_hetero.matformer.region_groups import RegionGroups
from lightning_hetero.replication import Bucket
from lightning_hetero.replication.settings import ReplicationSettings

MEMBERS = 3
SENTINEL = -7.0


class _Done:
    def wait(self) -> None:
        return None


def _inf_column() -> torch.Tensor:
    """Eight DCT coefficients of 3.4e38 (each finite in fp32) in column 0 of one 8x8 block: their inverse is Inf."""
    return torch.cat([pack_indices(torch.arange(0, 64, 8), 12), pack_values(torch.full((1, 8), 3.4e38), "fp32")])


def _ternary_code_3(wire: torch.Tensor, index_bytes: int) -> torch.Tensor:
    wire = wire.clone()
    wire[index_bytes] |= 0b11
    return wire


def _exchange(policy: str, values: str = "fp32"):
    exchange = CompressedExchange(
        RegionGroups(widths_for([0], 8)), 1 / 8, chunk=8, values=values, on_bad_payload=policy
    )
    replicator = build_demo_replicator(ReplicationSettings(kept_fraction=1 / 8, chunk=8, values=values))
    replicator.set_bad_payload_policy(policy)
    replicator.num_replicas = MEMBERS
    return exchange, replicator


def _finish(exchange, replicator, peers, view=None):
    """Encode this rank's 8x8 slab, gather it with ``peers(piece)``, finish into a view; return (view, piece, wires)."""
    error = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    piece = replicator.encode(0, error)
    wires = [piece.wire, *peers(piece)]
    bucket = Bucket([piece], "gather", piece.wire, torch.cat(wires), _Done(), time.perf_counter(), False, [0])
    view = torch.full((8, 8), SENTINEL) if view is None else view
    exchange.finish(_Launched(replicator, bucket, MEMBERS), [view])
    return view, piece, wires


def _honest(values: str = "fp32") -> torch.Tensor:
    other = build_demo_replicator(ReplicationSettings(kept_fraction=1 / 8, chunk=8, values=values))
    return other.encode(0, torch.randn(8, 8, generator=torch.Generator().manual_seed(1))).wire


def test_a_member_whose_finite_coefficients_decode_to_inf_is_refused_and_no_gradient_is_written():
    exchange, replicator = _exchange("raise")
    view = torch.full((8, 8), SENTINEL)
    with pytest.raises(PeerPayloadError, match="replica 1 sent") as error:
        _finish(exchange, replicator, lambda piece: [_inf_column(), _honest()], view)
    assert (error.value.peer, error.value.field) == (1, "values")
    assert bool((view == SENTINEL).all())


def test_drop_decodes_the_bucket_from_the_honest_members(caplog):
    exchange, replicator = _exchange("drop")
    with caplog.at_level(logging.WARNING, logger="lightning_hetero.peer_payloads"):
        view, piece, wires = _finish(exchange, replicator, lambda piece: [_inf_column(), _honest()])
    honest = build_demo_replicator(ReplicationSettings(kept_fraction=1 / 8, chunk=8))
    honest_mean = honest.decode_gathered(piece, [wires[0], wires[2]])
    assert torch.equal(view, honest_mean * MEMBERS)
    assert replicator.dropped_payloads == 1 and "replica 1" in caplog.text


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_a_ternary_code_3_from_a_member_is_never_applied(policy):
    exchange, replicator = _exchange(policy, "ternary")

    def peers(piece):
        return [_ternary_code_3(_honest("ternary"), piece.meta["index_bytes"]), _honest("ternary")]

    if policy == "raise":
        with pytest.raises(PeerPayloadError, match="ternary code 3") as error:
            _finish(exchange, replicator, peers)
        assert (error.value.peer, error.value.field) == (1, "values.codes")
        return
    view, piece, wires = _finish(exchange, replicator, peers)
    honest = build_demo_replicator(ReplicationSettings(kept_fraction=1 / 8, chunk=8, values="ternary")).decode_gathered(
        piece, [wires[0], wires[2]]
    )
    assert torch.equal(view, honest * MEMBERS)
