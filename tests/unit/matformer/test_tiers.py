"""Tier layouts, nested regions, helper draws, contributor counts and analytic bytes (pure functions, no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hetero.matformer.helper_ranks import (
    HelperConfig,
    drawn_neurons,
    helper_count,
    helper_neurons,
    helper_windows_for_full_coverage,
    trained_neurons,
    validate_helpers,
)
from lightning_hetero.matformer.layout import TierLayout, widths_for
from lightning_hetero.matformer.regions import Region, layer_regions, regions
from lightning_hetero.matformer.tiers import (
    bytes_per_step,
    check_mode,
    contributor_counts,
    contributor_weights,
    rank_weights,
    wire_dtype,
)
from lightning_hetero.matformer.types import FFNParameter

H = 1536


# ---------------------------------------------------------------------------------------------------- layouts
def test_widths_for_uniform_tiers() -> None:
    layout = widths_for([0, 0, 1, 2], H)
    assert layout == TierLayout(((1536,), (1536,), (768,), (384,)), (1536,), None)
    assert layout.world_size == 4 and layout.widths_at(7) == (1536, 1536, 768, 384)  # any layer when uniform
    assert [layout.tier(rank, 3) for rank in range(4)] == [0, 0, 1, 2]
    assert widths_for([1536, 768], H, unit="width").widths == ((1536,), (768,))


def test_widths_for_per_layer_mix_n_match() -> None:
    layout = widths_for([0, [1, 0, 2], [2, 2, 0]], [16, 32, 8])
    assert layout.num_layers == 3 and layout.full_sizes == (16, 32, 8)
    assert [layout.widths_at(layer) for layer in range(3)] == [(16, 8, 4), (32, 32, 8), (8, 2, 8)]
    assert [layout.full_size_at(layer) for layer in range(3)] == [16, 32, 8]
    explicit = widths_for([[12, 16], 16], 16, unit="width")
    assert explicit.widths_at(0) == (12, 16) and explicit.tier(0, 0) is None and explicit.tier(0, 1) == 0
    with pytest.raises(ValueError, match="outside this layout's 3 layers"):
        layout.widths_at(3)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([], 8), {}, "non-empty sequence"),
        (([0, [0, 1]], [8, 8, 8]), {}, "per-layer lengths disagree"),
        (([0, 1], 8), {"num_layers": 0}, "num_layers must be >= 1"),
        (([0, 3], 12), {}, "rank 1, layer 0: tier 3 needs the FFN size 12 to be divisible"),
        (([8, 0], 8), {"unit": "width"}, r"width 0 must be in \[1, full_size=8\]"),
        (([9], 8), {"unit": "width"}, "width 9 must be"),
        (([True], 8), {}, "must be an int"),
        (([0], 8), {"unit": "tiers"}, "unit must be 'tier' or 'width'"),
    ],
)
def test_widths_for_rejects_bad_input(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        widths_for(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------- regions
def test_regions_for_tiers_0_0_1_2() -> None:
    assert layer_regions(widths_for([0, 0, 1, 2], H)) == [
        Region(0, 384, (0, 1, 2, 3)),
        Region(384, 768, (0, 1, 2)),
        Region(768, 1536, (0, 1)),
    ]
    assert regions([1536, 384, 1536, 768]) == [  # rank order does not matter
        Region(0, 384, (0, 1, 2, 3)),
        Region(384, 768, (0, 2, 3)),
        Region(768, 1536, (0, 2)),
    ]
    assert regions([8, 8]) == [Region(0, 8, (0, 1))]  # homogeneous: one region, everyone
    assert regions([4, 2]) == [Region(0, 2, (0, 1)), Region(2, 4, (0,))]  # no tier 0: [4, h) belongs to nobody


def test_regions_per_layer() -> None:
    layout = widths_for([[0, 2], [1, 0], [2, 1]], 16)
    assert layer_regions(layout, 0) == [Region(0, 4, (0, 1, 2)), Region(4, 8, (0, 1)), Region(8, 16, (0,))]
    assert layer_regions(layout, 1) == [Region(0, 4, (0, 1, 2)), Region(4, 8, (1, 2)), Region(8, 16, (1,))]


def test_regions_with_helpers_join_their_tail_and_the_unowned_top() -> None:
    assert regions([16, 8, 4], helper_ranks=[2], full_size=16) == [
        Region(0, 4, (0, 1, 2)),
        Region(4, 8, (0, 1), (2,)),
        Region(8, 16, (0,), (2,)),
    ]
    no_tier0 = regions([8, 4], helper_ranks=[1], full_size=16)
    assert no_tier0 == [Region(0, 4, (0, 1)), Region(4, 8, (0,), (1,)), Region(8, 16, (), (1,))]
    assert no_tier0[1].members == (0, 1) and no_tier0[2].size == 8
    with pytest.raises(ValueError, match="helper rank 0 must be a rank with width < full_size"):
        regions([16, 8], helper_ranks=[0], full_size=16)
    with pytest.raises(ValueError, match="need full_size"):
        regions([16, 8], helper_ranks=[1])


# ---------------------------------------------------------------------------------------------------- helpers
def test_helper_count_is_floor_of_prefix_times_fraction() -> None:
    assert helper_count(768, 1 / 3) == 256  # the fork's example (prefix 768 of 3072); float error must not give 255
    assert helper_count(384, 0.1) == 38 and helper_count(5, 0.5) == 2 and helper_count(7, 0) == 0
    assert helper_neurons(768, 3072, 1 / 3, seed=0, step=0, redraw_every=16).numel() == 256
    assert helper_neurons(384, 1536, 0.1, seed=3, step=5, redraw_every=2).numel() == 38


def test_helper_draw_is_deterministic_fixed_within_a_window_and_rotates() -> None:
    def draw(step: int, seed: int = 7, layer: int = 0) -> list[int]:
        return helper_neurons(384, 1536, 0.25, seed, step, 4, layer=layer).tolist()

    first = draw(0)
    assert len(first) == 96 and first == sorted(set(first)) and all(384 <= j < 1536 for j in first)
    assert draw(0) == first and draw(3) == first  # same window: same subset, on every call and rank
    assert draw(4) != first and draw(0, seed=8) != first and draw(0, layer=1) != first
    # Pinned values: the draw is a pure integer hash, so it must never change across torch versions or platforms.
    assert helper_neurons(4, 16, 0.5, 0, 0, 1).tolist() == [8, 11]
    assert helper_neurons(4, 16, 0.5, 0, 1, 1).tolist() == [4, 7]


def test_helper_draw_covers_every_tail_neuron_within_the_promised_windows() -> None:
    for prefix, full, fraction in [(384, 1536, 0.25), (4, 16, 0.5), (768, 1536, 0.1), (5, 16, 0.4)]:
        windows = helper_windows_for_full_coverage(prefix, full, fraction)
        assert windows == math.ceil((full - prefix) / helper_count(prefix, fraction))
        seen: set[int] = set()
        for window in range(windows):
            seen.update(helper_neurons(prefix, full, fraction, 11, window * 3, 3).tolist())
        assert seen == set(range(prefix, full)), (prefix, full, fraction)


def test_seeded_permutation_hash_matches_a_plain_python_reference() -> None:
    from lightning_hetero.matformer.helper_ranks import _mix32

    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    values = [0, 1, 2, 65535, 65536, 12345678, 2**31, 2**32 - 1, 0xDEADBEEF]
    assert _mix32(torch.tensor(values)).tolist() == [lowbias32(v) for v in values]


def test_helper_draw_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="asks for 16 tail neurons but only 8 exist"):
        helper_neurons(8, 16, 2.0, 0, 0, 1)
    with pytest.raises(ValueError, match="fraction must be a finite number >= 0"):
        helper_neurons(8, 16, -0.5, 0, 0, 1)
    with pytest.raises(ValueError, match="step >= 0 and redraw_every >= 1"):
        helper_neurons(8, 16, 0.5, 0, -1, 1)
    with pytest.raises(ValueError, match="redraw_every must be an int >= 1"):
        HelperConfig(0.5, redraw_every=0)
    assert helper_neurons(8, 16, 0.0, 0, 0, 1).numel() == 0
    layout = widths_for([0, 1], 16)
    with pytest.raises(ValueError, match=r"helpers\[1\].fraction=1.5 draws 12 tail neurons in layer 0 but its tail"):
        validate_helpers(layout, {1: HelperConfig(1.5)})
    with pytest.raises(ValueError, match="rank 2 is not in"):
        validate_helpers(layout, {2: HelperConfig(0.5)})
    assert validate_helpers(layout, {0: HelperConfig(0.5), 1: HelperConfig(0.0)}) == {0: HelperConfig(0.5)}


def test_trained_neurons_and_contributor_counts_per_neuron() -> None:
    layout = widths_for([0, 0, 1, 2], 16)
    helpers = {2: HelperConfig(0.5, seed=1, redraw_every=2), 3: HelperConfig(1.0, seed=2)}
    assert contributor_counts(layout).tolist() == [4] * 4 + [3] * 4 + [2] * 8  # prefix / middle / tail
    step = 5
    drawn2 = drawn_neurons(layout, 2, helpers=helpers, step=step)
    drawn3 = drawn_neurons(layout, 3, helpers=helpers, step=step)
    assert drawn2.numel() == 4 and drawn3.numel() == 4 and drawn_neurons(layout, 0, helpers=helpers).numel() == 0
    assert trained_neurons(layout, 2, helpers=helpers, step=step).tolist() == list(range(8)) + drawn2.tolist()
    expected = torch.tensor([4] * 4 + [3] * 4 + [2] * 8)
    expected[drawn2] += 1
    expected[drawn3] += 1
    assert torch.equal(contributor_counts(layout, helpers=helpers, step=step), expected)
    assert layer_regions(layout, 0, helpers) == [
        Region(0, 4, (0, 1, 2, 3)),
        Region(4, 8, (0, 1, 2), (3,)),
        Region(8, 16, (0, 1), (2, 3)),
    ]
    # A helper at full width in some layer draws nothing there (Mix'n'Match).
    mixed = widths_for([0, [1, 0]], 8)
    assert drawn_neurons(mixed, 1, 1, helpers={1: HelperConfig(0.5)}).numel() == 0
    assert layer_regions(mixed, 1, {1: HelperConfig(0.5)}) == [Region(0, 8, (0, 1))]


def test_tier_weights_resolve_per_layer_and_weight_the_denominator() -> None:
    layout = widths_for([0, [1, 0], 2], 8)
    weights = {0: 1.0, 1: 2.0, 2: 4.0}
    assert rank_weights(layout, None, 0) == (1.0, 1.0, 1.0)
    assert rank_weights(layout, weights, 0) == (1.0, 2.0, 4.0)
    assert rank_weights(layout, weights, 1) == (1.0, 1.0, 4.0)
    assert rank_weights(layout, [1.0, 2.0, 4.0]) == (1.0, 1.0, 4.0)  # non-FFN: lowest tier of the rank
    assert contributor_weights(layout, 0, tier_weights=weights).tolist() == [7.0] * 2 + [3.0] * 2 + [1.0] * 4
    with pytest.raises(ValueError, match="no weight for tier 2"):
        rank_weights(layout, {0: 1.0, 1: 1.0}, 0)
    with pytest.raises(ValueError, match="must be finite and > 0"):
        rank_weights(layout, {0: 1.0, 1: 0.0, 2: 1.0}, 0)
    with pytest.raises(ValueError, match="need power-of-two widths"):
        rank_weights(widths_for([8, 6], 8, unit="width"), weights, 0)


# ---------------------------------------------------------------------------------------------------- modes, bytes
def test_modes() -> None:
    assert check_mode("mean") == "mean" and check_mode("sign") == "sign" and check_mode("demo") == "demo"
    with pytest.raises(ValueError, match="mode must be one of"):
        check_mode("median")
    assert wire_dtype("mean", torch.bfloat16, True, 4) == torch.bfloat16
    assert wire_dtype("demo", torch.bfloat16, True, 200) == torch.bfloat16  # buckets built in the grad dtype
    assert wire_dtype("sign", torch.bfloat16, False, 127) == torch.int8
    assert wire_dtype("sign", torch.float32, False, 128) == torch.int32
    assert wire_dtype("sign", torch.float32, True, 4) == torch.float32


def _llama_like(d: int, h: int, layers: int = 1) -> tuple[list[FFNParameter], dict[str, tuple[int, ...]]]:
    ffn, shapes = [], {}
    for layer in range(layers):
        for proj, shape, axis in (("gate", (h, d), 0), ("up", (h, d), 0), ("down", (d, h), 1)):
            name = f"layers.{layer}.mlp.{proj}.weight"
            ffn.append(FFNParameter(name, axis, h, layer))
            shapes[name] = shape
    return ffn, shapes


def test_bytes_per_step_worked_example_tiers_0_0_1_2() -> None:
    d, h = 512, 1536
    ffn, shapes = _llama_like(d, h)
    layout = widths_for([0, 0, 1, 2], h)
    slab = 384 * 3 * d * 4  # bytes of 384 neurons of gate + up + down in float32
    assert slab == 2_359_296
    tier2 = 2 * 3 * slab // 4  # [0, 384) among 4 ranks
    tier1 = tier2 + 2 * 2 * slab // 3  # + [384, 768) among 3
    tier0 = tier1 + 2 * 1 * (2 * slab) // 2  # + [768, 1536) among 2
    assert bytes_per_step(layout, ffn, shapes) == [tier0, tier0, tier1, tier2] == [11403264] * 2 + [6684672, 3538944]
    ddp = 2 * 3 * (4 * slab) // 4
    assert bytes_per_step(widths_for([0] * 4, h), ffn, shapes) == [ddp] * 4 == [14155776] * 4
    assert bytes_per_step(layout, ffn, shapes, mode="sign") == [b // 4 for b in [tier0, tier0, tier1, tier2]]
    # Non-FFN parameters ride in the all-ranks bucket; bf16 halves everything; one bucket per rank set.
    shapes["embed"] = (100, d)
    with_embed = bytes_per_step(layout, ffn, shapes, dtypes=torch.bfloat16)
    assert with_embed[3] == 2 * 3 * (slab // 2 + 100 * d * 2) // 4


def test_bytes_per_step_with_helpers_and_rounding() -> None:
    layout = widths_for([0, 1], 8)
    ffn = [FFNParameter("up", 0, 8, 0)]
    shapes = {"up": (8, 3), "bias": (1,)}
    # Without helpers: [0, 4) + bias among 2 ranks; [4, 8) alone on rank 0 moves nothing.
    assert bytes_per_step(layout, ffn, shapes) == [(4 * 3 + 1) * 4] * 2
    # The helper joins [4, 8) densely: it then pays what a tier-0 rank pays.
    assert bytes_per_step(layout, ffn, shapes, helpers={1: HelperConfig(0.5)}) == [(8 * 3 + 1) * 4] * 2
    # 3 int8 votes among 4 ranks: floor(2 * 3 * 3 / 4) = 4 bytes (the ledger's rounding, once per bucket).
    assert bytes_per_step(widths_for([0] * 4, 1), [], {"b": (3,)}, mode="sign") == [4] * 4
