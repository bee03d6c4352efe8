"""Hostile or corrupt replica payloads: rejected with a clear error naming the replica, never applied or crashing.

Every FlexDeMo decode path (DeMo / top-k gathered, dense gathered, dense all-reduced, DiLoCo's outer delta) keeps the
decoder rule of ``tests/payload_rule.py``: finite values of magnitude at most ``MAX_PEER_MAGNITUDE`` of the piece's
shape, or a ``PeerPayloadError`` naming the replica and the field. Several replicas are simulated in one process by
:class:`_Peers`, which hands the optimizer a gathered buffer holding its own bytes and forged peers' bytes (the
collective is not what is tested here; ``tests/dist/test_peer_payloads.py`` runs the real one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hetero.comm.payload_packing import pack_indices, pack_values
from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError
from lightning_hetero.flexdemo.optim import DecoupledAdamW
from lightning_hetero.replication import Bucket, DeMoReplicator, FullReplicator, Piece, build_replicator
from tests.payload_rule import assert_decoder_rule

FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
F32_MAX = 3.4e38  # finite in fp32; eight of them in one DCT column sum to Inf


def _demo_piece(values: str = "fp32"):
    replicator = build_replicator("demo", 1 / 32, chunk=32, values=values, index_bits=12)
    piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))
    return replicator, piece


def _wire(indices: torch.Tensor, values: torch.Tensor, encoding: str = "fp32", bits: int = 12) -> torch.Tensor:
    return torch.cat([pack_indices(indices, bits), pack_values(values, encoding)])


def _column(value: float = F32_MAX) -> torch.Tensor:
    """An 8x8 DeMo payload (one block, k = 8): the eight coefficients of DCT column 0, each ``value``."""
    return _wire(torch.arange(0, 64, 8), torch.full((1, 8), value))


def _column_replicator(**options) -> DeMoReplicator:
    replicator = build_replicator("demo", 1 / 8, chunk=8, values="fp32", **options)
    assert isinstance(replicator, DeMoReplicator)
    return replicator


def _honest(seed: int, shape: tuple[int, ...] = (8, 8), **options) -> torch.Tensor:
    source = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return _column_replicator(**options).encode(0, source).wire


# ------------------------------------------------------------------------------------------- refused fields
def test_an_out_of_range_coefficient_index_is_refused_naming_the_replica():
    replicator, piece = _demo_piece()
    k = piece.meta["k"]
    indices = torch.full((k,), 4000, dtype=torch.long)  # a 32x32 block has 1024 coefficients; 12 bits reach 4095
    forged = torch.cat([pack_indices(indices, 12), pack_values(torch.ones(1, k), "fp32")])
    with pytest.raises(
        PeerPayloadError, match="replica 1 sent index 4000 for parameter piece 0.*1024 coefficients"
    ) as error:
        replicator.decode_gathered(piece, [piece.wire, forged])
    assert (error.value.peer, error.value.field) == (1, "indices")


@pytest.mark.parametrize(("name", "values"), [("demo", "fp32"), ("topk", "fp32"), ("random", "sign")])
def test_non_finite_values_from_a_peer_are_refused(name, values):
    options = {"chunk": 32} if name in ("demo", "topk") else {}
    replicator = build_replicator(name, 1 / 8, values=values, **options)
    piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(1)))
    forged = piece.wire.clone()
    forged[-4:].view(torch.float32)[0] = float("nan")  # the last fp32 value (sign: the scale) of the payload
    with pytest.raises(PeerPayloadError, match="replica 1 sent non-finite values") as error:
        replicator.decode_gathered(piece, [piece.wire, forged])
    assert error.value.peer == 1


def test_finite_coefficients_that_decode_to_inf_are_refused_naming_the_replica():
    replicator = _column_replicator()
    piece = replicator.encode(0, torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(PeerPayloadError, match="replica 1 sent .*magnitude") as error:
        replicator.decode_gathered(piece, [piece.wire, _column()])
    assert (error.value.peer, error.value.field) == (1, "values")


def test_a_duplicate_coefficient_index_is_refused():
    replicator = _column_replicator()
    piece = replicator.encode(0, torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    forged = _wire(torch.tensor([3, 3, 4, 5, 6, 7, 8, 9]), torch.ones(1, 8))
    with pytest.raises(PeerPayloadError, match="replica 1 .*repeats an index") as error:
        replicator.decode_gathered(piece, [piece.wire, forged])
    assert (error.value.peer, error.value.field) == (1, "indices")


def _ternary_with_code_3(wire: torch.Tensor, index_bytes: int) -> torch.Tensor:
    wire = wire.clone()
    wire[index_bytes] |= 0b11  # the first value's 2-bit code becomes 3 (not a ternary code)
    return wire


def _negative_scale(wire: torch.Tensor, index_bytes: int) -> torch.Tensor:
    wire = wire.clone()
    scale = wire[-4:].clone().view(torch.float32)
    wire[-4:] = (-scale.abs() - 1.0).view(torch.uint8)
    return wire


@pytest.mark.parametrize("name", ["demo", "topk"])
@pytest.mark.parametrize(
    ("values", "forge", "field", "match"),
    [
        ("ternary", _ternary_with_code_3, "values.codes", "ternary code 3"),
        ("ternary", _negative_scale, "values.scale", "negative scale"),
        ("sign", _negative_scale, "values.scale", "negative scale"),
    ],
)
def test_invalid_low_bit_codes_and_negative_scales_are_refused(name, values, forge, field, match):
    replicator = build_replicator(name, 1 / 8, chunk=8, values=values)
    piece = replicator.encode(0, torch.randn(8, 8, generator=torch.Generator().manual_seed(3)))
    forged = forge(piece.wire, piece.meta["index_bytes"])
    with pytest.raises(PeerPayloadError, match=f"replica 1 .*{match}") as error:
        replicator.decode_gathered(piece, [piece.wire, forged])
    assert (error.value.peer, error.value.field) == (1, field)


@pytest.mark.parametrize("name", ["random", "striding", "full"])
@pytest.mark.parametrize(
    ("values", "forge", "field"),
    [("ternary", _ternary_with_code_3, "values.codes"), ("sign", _negative_scale, "values.scale")],
)
def test_dense_gathered_low_bit_payloads_refuse_invalid_codes_and_scales(name, values, forge, field):
    replicator = build_replicator(name, 1 / 4, values=values)
    piece = replicator.encode(0, torch.randn(8, 8, generator=torch.Generator().manual_seed(4)))
    with pytest.raises(PeerPayloadError, match="replica 1 ") as error:
        replicator.decode_gathered(piece, [piece.wire, forge(piece.wire, 0)])
    assert (error.value.peer, error.value.field) == (1, field)


def test_a_non_finite_all_reduce_is_refused():
    replicator = build_replicator("random", 1 / 8, values="fp32")
    piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(2)))
    summed = piece.wire.clone().float()
    summed[0] = float("inf")
    with pytest.raises(PeerPayloadError, match="all-reduced values for parameter piece 0 are non-finite"):
        replicator.decode_reduced(piece, summed)


def test_a_finite_all_reduce_above_the_bound_is_refused_and_dropped_as_a_zero_update():
    replicator = build_replicator("full", values="fp32")
    replicator.num_replicas = 2
    piece = replicator.encode(0, torch.randn(4, 4, generator=torch.Generator().manual_seed(2)))
    summed = piece.wire.clone()
    summed[3] = F32_MAX  # finite, and so is its mean over two replicas: both far above any healthy gradient
    with pytest.raises(PeerPayloadError, match="magnitude"):
        replicator.decode_reduced(piece, summed)
    replicator.set_bad_payload_policy("drop")
    assert torch.equal(replicator._decode_reduced_or_drop(piece, summed), torch.zeros(4, 4))


# --------------------------------------------------------------------------------------------- drop policy
@pytest.mark.parametrize("combine", ["mean", "pickers"])
def test_drop_leaves_out_the_inf_column_and_combines_the_honest_replicas(combine, caplog):
    replicator = _column_replicator(combine=combine)
    replicator.set_bad_payload_policy("drop")
    piece = replicator.encode(0, torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    honest = _honest(1)
    with caplog.at_level(logging.WARNING, logger="lightning_hetero.peer_payloads"):
        combined = replicator._decode_gathered_or_drop(piece, [piece.wire, _column(), honest])
    assert torch.equal(combined, replicator.decode_gathered(piece, [piece.wire, honest]))
    assert replicator.dropped_payloads == 1 and "replica 1" in caplog.text


# ------------------------------------------------------------------------------------ the optimizer path
class _Done:
    """A completed collective (``Bucket.work``)."""

    def wait(self) -> None:
        return None


class _Peers(DeMoReplicator):
    """A DeMo replicator whose gathered buffer holds its own bytes followed by each simulated peer's bytes."""

    def __init__(self, peers: list[Callable[[Piece], torch.Tensor]], **options) -> None:
        super().__init__(1 / 8, chunk=8, values="fp32", **options)
        self.peers = peers
        self.num_replicas = 1 + len(peers)
        self.gathered: list[list[torch.Tensor]] = []

    def launch(self, pieces: list[Piece], *, early: bool = False) -> Bucket:
        own = torch.cat([piece.wire for piece in pieces])
        per_rank = [own] + [torch.cat([peer(piece) for piece in pieces]) for peer in self.peers]
        self.gathered.append(per_rank)
        offsets = [sum(p.wire.numel() for p in pieces[:i]) for i in range(len(pieces))]
        return Bucket(pieces, "gather", own, torch.cat(per_rank), _Done(), time.perf_counter(), early, offsets)


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_decoupled_adamw_never_applies_the_inf_column(policy):
    """DecoupledAdamW with sign off adds the combined update itself: a 3.4e38 column must never reach the weights."""
    honest = _honest(7)
    replicator = _Peers([lambda piece: _column(), lambda piece: honest])
    replicator.set_bad_payload_policy(policy)
    param = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(5)))
    optimizer = DecoupledAdamW([param], lr=0.1, weight_decay=0.0, sign=False, replicator=replicator)
    param.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(6))
    before = param.detach().clone()
    if policy == "raise":
        with pytest.raises(PeerPayloadError, match="replica 1") as error:
            optimizer.step()
        assert error.value.peer == 1
        assert torch.equal(param.detach(), before)
        return
    optimizer.step()
    own, _, honest_wire = replicator.gathered[0]
    piece = Piece(0, (8, 8), own, {"k": 8, "index_bytes": 12})
    honest_mean = _column_replicator().decode_gathered(piece, [own, honest_wire])
    assert bool(torch.isfinite(param).all())
    assert torch.equal(param.detach(), before.add(honest_mean, alpha=-0.1))
    assert replicator.dropped_payloads == 1


def test_no_parameter_moves_when_a_later_bucket_is_refused():
    """Raise: every bucket is decoded and checked before the first parameter is touched."""
    honest = _honest(7)
    forged = {1: _column()}  # the second parameter's payload from replica 1 is the Inf column
    replicator = _Peers([lambda piece: forged.get(piece.key, honest)])
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    optimizer = DecoupledAdamW(params, lr=0.1, weight_decay=0.0, sign=False, replicator=replicator)
    for param in params:
        param.grad = torch.ones(8, 8)
    before = [param.detach().clone() for param in params]
    optimizer.launch([params[0]])  # its own bucket, finished first
    with pytest.raises(PeerPayloadError, match="replica 1"):
        optimizer.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


class _Unchecked(FullReplicator):
    """A third-party replicator that skips the combined check: the optimizer's own check must still hold."""

    def decode_reduced(self, piece: Piece, summed: torch.Tensor) -> torch.Tensor:
        return self._expand(piece, summed.float() / self.num_replicas)


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_the_optimizer_refuses_an_out_of_bound_combination_from_any_replicator(policy):
    replicator = _Unchecked()
    replicator.set_bad_payload_policy(policy)
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = DecoupledAdamW([param], lr=0.1, weight_decay=0.0, replicator=replicator)
    param.grad = torch.tensor([1.0, F32_MAX, 1.0, 1.0])  # finite; squared into Adam's second moment it is Inf
    if policy == "raise":
        with pytest.raises(PeerPayloadError, match="magnitude") as error:
            optimizer.step()
        assert error.value.field == "combined"
        assert torch.equal(param.detach(), torch.ones(4)) and not optimizer.state[param]
        return
    optimizer.step()  # the piece gets a zero update, like a refused all-reduce
    assert torch.equal(param.detach(), torch.ones(4)) and replicator.dropped_payloads == 1
    assert all(bool(torch.isfinite(value).all()) for value in optimizer.state[param].values())


# ------------------------------------------------------------------------------------------------- fuzzing
def _layout(shape: tuple[int, ...]) -> Callable[[torch.Tensor], None]:
    def check(result: torch.Tensor) -> None:
        assert tuple(result.shape) == shape and result.dtype == torch.float32

    return check


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary())
def test_random_bytes_as_a_peer_payload_never_crash_or_apply_garbage(data):
    replicator, piece = _demo_piece()
    size = piece.wire.numel()
    raw = (data * (size // max(len(data), 1) + 1))[:size] if data else bytes(size)
    forged = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
    assert_decoder_rule(lambda: replicator.decode_gathered(piece, [piece.wire, forged]), check_layout=_layout((32, 32)))


DECODERS = [
    ("demo", "fp32"),
    ("demo", "bf16"),
    ("demo", "sign"),
    ("demo", "ternary"),
    ("topk", "fp32"),
    ("topk", "ternary"),
    ("random", "sign"),
    ("random", "ternary"),
    ("striding", "ternary"),
    ("full", "sign"),
]


@pytest.mark.parametrize(("name", "values"), DECODERS)
@FUZZ
@given(data=st.binary(min_size=1, max_size=300), truncate=st.integers(0, 3))
def test_random_bytes_of_any_length_keep_the_rule(name, values, data, truncate):
    options = {"chunk": 8} if name in ("demo", "topk") else {}
    replicator = build_replicator(name, 1 / 4, values=values, **options)
    piece = replicator.encode(0, torch.randn(8, 12, generator=torch.Generator().manual_seed(0)))
    size = max(piece.wire.numel() - truncate, 0)
    raw = (data * (size // len(data) + 1))[:size]
    forged = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone() if raw else torch.zeros(0, dtype=torch.uint8)
    result = assert_decoder_rule(
        lambda: replicator.decode_gathered(piece, [piece.wire, forged]), peer=1, check_layout=_layout((8, 12))
    )
    if truncate:
        assert result is None  # a short payload is never applied


@pytest.mark.parametrize(("name", "values"), DECODERS)
@FUZZ
@given(position=st.integers(0, 10**6), byte=st.integers(0, 255))
def test_a_valid_payload_with_one_corrupted_byte_keeps_the_rule(name, values, position, byte):
    options = {"chunk": 8} if name in ("demo", "topk") else {}
    replicator = build_replicator(name, 1 / 4, values=values, **options)
    piece = replicator.encode(0, torch.randn(8, 12, generator=torch.Generator().manual_seed(0)))
    peer = replicator.encode(0, torch.randn(8, 12, generator=torch.Generator().manual_seed(1)))
    forged = peer.wire.clone()
    forged[position % forged.numel()] = byte
    assert_decoder_rule(
        lambda: replicator.decode_gathered(piece, [piece.wire, forged]), peer=1, check_layout=_layout((8, 12))
    )


@pytest.mark.parametrize("name", ["demo", "topk"])
@pytest.mark.parametrize("combine", ["mean", "pickers"])
@pytest.mark.parametrize("values", ["fp32", "sign", "ternary"])
@FUZZ
@given(
    replicas=st.integers(2, 4),
    magnitude=st.floats(2.0**40, MAX_PEER_MAGNITUDE),
    negative=st.booleans(),
    column=st.integers(0, 7),
)
def test_values_finite_alone_but_huge_combined_keep_the_rule(
    name, combine, values, replicas, magnitude, negative, column
):
    """Every replica but one sends bounded coefficients in one DCT column: the combination must stay bounded too."""
    replicator = build_replicator(name, 1 / 8, chunk=8, values=values, combine=combine)
    piece = replicator.encode(0, torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    big = _wire(torch.arange(column, 64, 8), torch.full((1, 8), -magnitude if negative else magnitude), values)
    per_rank = [piece.wire] + [big] * (replicas - 1)
    assert_decoder_rule(lambda: replicator.decode_gathered(piece, per_rank), check_layout=_layout((8, 8)))
    replicator.set_bad_payload_policy("drop")
    assert_decoder_rule(lambda: replicator._decode_gathered_or_drop(piece, per_rank), check_layout=_layout((8, 8)))


@pytest.mark.parametrize("name", ["random", "striding", "full"])
@pytest.mark.parametrize("values", ["sign", "ternary"])
@FUZZ
@given(replicas=st.integers(2, 4), magnitude=st.floats(2.0**40, MAX_PEER_MAGNITUDE), negative=st.booleans())
def test_dense_gathered_values_finite_alone_but_huge_combined_keep_the_rule(
    name, values, replicas, magnitude, negative
):
    replicator = build_replicator(name, 1 / 4, values=values)
    piece = replicator.encode(0, torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    slots = piece.meta["slots"]
    big = pack_values(torch.full((1, slots), -magnitude if negative else magnitude), values)
    per_rank = [piece.wire] + [big] * (replicas - 1)
    assert_decoder_rule(lambda: replicator.decode_gathered(piece, per_rank), check_layout=_layout((4, 8)))


@pytest.mark.parametrize("name", ["random", "striding", "full"])
@FUZZ
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=8))
def test_all_reduced_sums_keep_the_rule(name, values):
    replicator = build_replicator(name, 1 / 4, values="fp32")
    replicator.num_replicas = 2
    piece = replicator.encode(0, torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    summed = torch.tensor((values * 32)[: piece.wire.numel()], dtype=torch.float32)
    assert_decoder_rule(lambda: replicator.decode_reduced(piece, summed), check_layout=_layout((4, 8)))


@FUZZ
@given(position=st.integers(0, 10**6), byte=st.integers(0, 255))
def test_diloco_outer_compressed_delta_keeps_the_rule(position, byte):
    replicator = build_replicator("diloco", 1 / 4, outer_kept_fraction=1 / 8, outer_chunk=8, values="ternary")
    codec = replicator.outer_codec
    assert codec is not None
    piece = codec.encode(0, torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    forged = codec.encode(0, torch.randn(8, 8, generator=torch.Generator().manual_seed(1))).wire.clone()
    forged[position % forged.numel()] = byte
    assert_decoder_rule(
        lambda: codec.decode_gathered(piece, [piece.wire, forged]), peer=1, check_layout=_layout((8, 8))
    )
