"""Replicators in one process: construction errors, coverage schedules, error feedback, combine modes, payload sizes."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hetero.replication import REPLICATORS, build_replicator, coordinate_schedule, kept_count


# --------------------------------------------------------------------------------------------------- errors
def test_registry_names() -> None:
    assert sorted(REPLICATORS) == ["demo", "diloco", "full", "random", "striding", "topk"]
    assert not build_replicator("full").compresses
    assert all(build_replicator(name).compresses for name in REPLICATORS if name != "full")


def test_unknown_replicator_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"replicator must be one of \['demo', 'diloco', 'full', 'random'"):
        build_replicator("deto-demo")


@pytest.mark.parametrize("kept_fraction", [0, -0.5, 1.5, float("nan"), "1/32", True])
@pytest.mark.parametrize("name", sorted(REPLICATORS))
def test_compression_outside_unit_interval(name: str, kept_fraction: object) -> None:
    with pytest.raises(ValueError, match=r"kept_fraction must be a number in \(0, 1\]"):
        build_replicator(name, kept_fraction)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk", [0, 257, 3.0, True])
def test_bad_chunk(chunk: object) -> None:
    with pytest.raises(ValueError, match=r"chunk must be an integer in \[1, 256\]"):
        build_replicator("demo", chunk=chunk)


def test_index_bits_must_address_the_block() -> None:
    assert build_replicator("demo", chunk=64).index_bits == 12  # auto
    assert build_replicator("demo", chunk=128).index_bits == 16  # auto
    with pytest.raises(ValueError, match="index_bits=12 cannot address chunk=128.*use index_bits=16 or chunk <= 64"):
        build_replicator("demo", chunk=128, index_bits=12)
    with pytest.raises(ValueError, match="index_bits=12 cannot address chunk=65"):
        build_replicator("topk", chunk=65, index_bits=12)
    with pytest.raises(ValueError, match=r"index_bits must be one of \[12, 16\]"):
        build_replicator("demo", index_bits=8)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match=r"values must be one of \['fp32', 'bf16', 'sign', 'ternary'\]"):
        build_replicator("random", values="int8")
    with pytest.raises(ValueError, match=r"combine must be one of \['mean', 'pickers'\]"):
        build_replicator("demo", combine="sum")
    with pytest.raises(ValueError, match=r"does not take option\(s\) \['chunk'\]"):
        build_replicator("random", chunk=64)
    with pytest.raises(ValueError, match="sync_every must be a positive integer"):
        build_replicator("diloco", sync_every=0)
    with pytest.raises(ValueError, match="outer_momentum must be in"):
        build_replicator("diloco", outer_momentum=1.0)
    assert build_replicator("random", chunk=None, index_bits=None).name == "random"  # None options are dropped


def test_diloco_sync_every_defaults_to_inverse_compression() -> None:
    assert build_replicator("diloco", 1 / 32).sync_every == 32
    assert build_replicator("diloco", 1.0).sync_every == 1
    assert build_replicator("diloco", 1 / 8, sync_every=3).sync_every == 3


def test_kept_count() -> None:
    assert kept_count(1 / 32, 4096) == 128
    assert kept_count(0.07, 100) == 7  # 0.07 * 100 = 7.000000000000001
    assert kept_count(1 / 32, 8) == 1  # at least one
    assert kept_count(0.5, 0) == 0


# ------------------------------------------------------------------------------------------------- coverage
@pytest.mark.parametrize("kind", ["random", "striding"])
@pytest.mark.parametrize(("numel", "kept_fraction"), [(64, 1 / 16), (64, 1 / 8), (97, 0.1), (10, 0.3), (1, 0.5)])
def test_every_coordinate_covered_once_per_cycle(kind: str, numel: int, kept_fraction: float) -> None:
    slots = kept_count(kept_fraction, numel)
    period = math.ceil(numel / slots)
    for cycle in range(3):
        seen: list[int] = []
        for step in range(cycle * period, (cycle + 1) * period):
            slot_ids, coordinates = coordinate_schedule(kind, numel, slots, step, seed=3, key=1)
            assert len(slot_ids) == len(coordinates) <= slots
            seen += coordinates.tolist()
        assert sorted(seen) == list(range(numel)), f"{kind}: cycle {cycle} did not cover every coordinate once"


def test_striding_rotates_where_the_anchor_was_stuck() -> None:
    # The anchor sent rows (0, 16, 32, 48) forever at rate 1/16 on 64 rows.
    firsts = {coordinate_schedule("striding", 64, 4, step)[1].tolist()[0] for step in range(16)}
    assert firsts == set(range(16))


def test_random_draws_differ_per_step_cycle_and_parameter() -> None:
    def draw(step: int, key: int = 0, seed: int = 0) -> list[int]:
        return coordinate_schedule("random", 1000, 10, step, seed=seed, key=key)[1].tolist()

    assert draw(0) != draw(1)
    assert draw(0) != draw(100)  # next cycle: another permutation
    assert draw(0) != draw(0, key=1) and draw(0) != draw(0, seed=1)
    assert draw(5) == draw(5)  # a pure function of (seed, key, step): identical on every replica and after resume


@pytest.mark.parametrize("name", ["random", "striding"])
def test_scheduled_replicator_sends_exactly_the_selected_coordinates(name: str, device: torch.device) -> None:
    replicator = build_replicator(name, 0.25)
    source = torch.randn(5, 4).to(device)
    before = source.clone()
    piece = replicator.encode(0, source)
    combined = replicator.finish(replicator.launch([piece]))[0]
    assert combined.device == device
    sent = combined != 0
    assert sent.sum().item() == 5
    assert torch.equal(combined[sent], before[sent])  # one replica: the mean is its own value
    zeros = torch.zeros(5, device=device)
    assert torch.equal(source[sent], zeros) and torch.equal(source[~sent], before[~sent])  # error feedback


# --------------------------------------------------------------------------------------- error feedback / decode
@pytest.mark.parametrize("values", ["fp32", "bf16", "sign", "ternary"])
@pytest.mark.parametrize("name", ["demo", "topk"])
def test_error_feedback_identity(name: str, values: str, device: torch.device) -> None:
    """before == after + decode(own payload): what left the buffer is exactly what receivers decode."""
    replicator = build_replicator(name, 1 / 8, chunk=4, values=values)
    source = torch.randn(9, 7, generator=torch.Generator().manual_seed(0)).to(device)
    before = source.clone()
    piece = replicator.encode(0, source)
    assert piece.wire.numel() == replicator.payload_bytes([source.shape])
    assert piece.wire.dtype == torch.uint8 and piece.wire.device == device  # packed bytes: NCCL and gloo move uint8
    combined = replicator.finish(replicator.launch([piece]))[0]
    assert combined.device == device
    assert torch.allclose(source + combined, before, atol=1e-6)
    assert not torch.allclose(source, before)


def test_demo_sends_the_largest_dct_coefficients(device: torch.device) -> None:
    replicator = build_replicator("demo", 1 / 16, chunk=4)  # one of 16 coefficients per 4 x 4 block
    block = torch.ones(4, 4, device=device)  # all energy in the DC coefficient
    combined = replicator.finish(replicator.launch([replicator.encode(0, block.clone())]))[0]
    assert torch.allclose(combined, block, atol=1e-6)


def test_combine_mean_versus_pickers(device: torch.device) -> None:
    """Two ranks, hand-made payloads: an index picked by both averages, one picked by one rank is halved (mean)
    or kept (pickers)."""
    for combine, expected in (("mean", [2.0, 2.5, 0.5]), ("pickers", [2.0, 5.0, 1.0])):
        replicator = build_replicator("topk", 0.5, chunk=2, combine=combine)  # FlatChunks: no transform
        replicator.num_replicas = 2
        rank0 = replicator.encode(0, torch.tensor([1.0, 5.0, 0.0, 0.0], device=device))  # sends indices 0, 1 (1, 5)
        rank1 = replicator.encode(0, torch.tensor([3.0, 0.0, 1.0, 0.0], device=device))  # sends indices 0, 2 (3, 1)
        combined = replicator.decode_gathered(rank0, [rank0.wire, rank1.wire])
        assert combined[:3].tolist() == expected, combine


def test_empty_and_scalar_shards(device: torch.device) -> None:
    for name in REPLICATORS:
        replicator = build_replicator(name, 0.5)
        pieces = [
            replicator.encode(0, torch.zeros(0, 3, device=device)),
            replicator.encode(1, torch.ones((), device=device)),
        ]
        combined = replicator.finish(replicator.launch(pieces))
        assert combined[0].shape == (0, 3) and combined[1].shape == ()
        assert all(tensor.device == device for tensor in combined), name
        assert replicator.payload_bytes([(0, 3)]) == 0
