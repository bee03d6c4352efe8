"""The tier chooser of ``tiers: auto`` on fixed measurements: memory, speed, impossible fits, determinism."""

from __future__ import annotations

import json

import pytest

from lightning_hetero.hetero.tier_choice import TierMeasurement, TierProbe, choose_tiers

GIB = 2**30

# A model whose training peak is 8 GiB at tier 0, 5 at tier 1, 3.5 at tier 2 and 2.75 at tier 3, and whose step takes
# 1.0 s at tier 0, 0.6 s at tier 1, 0.4 at tier 2, 0.3 at tier 3 on the fast machine.
PEAKS = {0: 8 * GIB, 1: 5 * GIB, 2: 7 * GIB // 2, 3: 11 * GIB // 4}
STEPS = {0: 1.0, 1: 0.6, 2: 0.4, 3: 0.3}


def _rank(rank: int, limit: int | None, slowdown: float = 1.0, skip_over: int | None = None) -> TierMeasurement:
    """A rank measuring the table above, ``slowdown`` times slower; tiers with a peak over ``skip_over`` unprobed."""
    tiers = {
        tier: TierProbe(None, None)
        if skip_over is not None and PEAKS[tier] > skip_over
        else TierProbe(STEPS[tier] * slowdown, PEAKS[tier])
        for tier in STEPS
    }
    return TierMeasurement(rank, limit, tiers)


def test_equal_ranks_all_get_tier_0():
    choice = choose_tiers([_rank(0, 16 * GIB), _rank(1, 16 * GIB), _rank(2, None)])
    assert choice.per_rank == [0, 0, 0]
    assert choice.reference_seconds == 1.0
    assert len(choice.lines) == 3 and choice.lines[1].startswith("rank 1: tier 0;")


def test_memory_rank_1_below_the_full_peak_but_above_tier_1_gets_tier_1():
    # 7 GiB * 0.9 = 6.3 GiB budget: tier 0 (8 GiB) misses, tier 1 (5 GiB) fits.
    choice = choose_tiers([_rank(0, 16 * GIB), _rank(1, 7 * GIB)])
    assert choice.per_rank == [0, 1]
    assert "peak 5.00 GiB of limit 7.00 GiB (budget 6.30 GiB)" in choice.lines[1]


def test_a_tier_that_was_not_probed_never_fits():
    choice = choose_tiers([_rank(0, 16 * GIB), _rank(1, 6 * GIB, skip_over=6 * GIB)])
    assert choice.per_rank == [0, 1]


def test_headroom_is_kept_free():
    # 5.4 GiB limit: 5 GiB fits with no headroom, not with 10% (4.86 GiB budget).
    assert choose_tiers([_rank(0, None), _rank(1, int(5.4 * GIB))], memory_headroom=0.0).per_rank == [0, 1]
    assert choose_tiers([_rank(0, None), _rank(1, int(5.4 * GIB))], memory_headroom=0.1).per_rank == [0, 2]


def test_speed_a_twice_slower_rank_gets_the_tier_that_brings_it_within_the_limit():
    # Twice as slow: tier 0 2.0 s, tier 1 1.2 s (> 1.1 s), tier 2 0.8 s (fits).
    choice = choose_tiers([_rank(0, None), _rank(1, None, slowdown=2.0)])
    assert choice.per_rank == [0, 2]
    assert "0.80x the reference 1.0000 s (at most 1.1x)" in choice.lines[1]
    # A looser limit lets it train wider.
    assert choose_tiers([_rank(0, None), _rank(1, None, slowdown=2.0)], max_slowdown=1.25).per_rank == [0, 1]


def test_the_reference_is_the_fastest_fitting_tier0_step():
    # Rank 2 is faster at tier 0 but cannot hold it: rank 0's step is the reference.
    fast_small = _rank(2, 6 * GIB, slowdown=0.5)
    choice = choose_tiers([_rank(0, None), _rank(1, None), fast_small])
    assert choice.reference_seconds == 1.0
    assert choice.per_rank == [0, 0, 1]


def test_speed_and_memory_together():
    choice = choose_tiers([_rank(0, None), _rank(1, 7 * GIB, slowdown=1.5), _rank(2, 4 * GIB)])
    # rank 1: tier 1 fits memory but 0.9 s <= 1.1 s: tier 1; rank 2: budget 3.6 GiB -> tier 2 (3.5 GiB).
    assert choice.per_rank == [0, 1, 2]


def test_impossible_fit_names_the_rank_the_numbers_and_the_fixes():
    with pytest.raises(ValueError) as error:
        choose_tiers([_rank(0, None), _rank(1, 2 * GIB)])
    text = str(error.value)
    assert "rank 1 (limit 2.00 GiB, budget 1.80 GiB)" in text
    assert "tier 3: step 0.3000 s, peak 2.75 GiB" in text and "tier 0: step 1.0000 s, peak 8.00 GiB" in text
    assert "reference 1.0000 s" in text
    for fix in ("raise max_slowdown", "more memory", "narrower candidate tiers", "leave that node out"):
        assert fix in text


def test_a_rank_too_slow_at_every_tier_is_impossible():
    with pytest.raises(ValueError, match=r"rank 1 .*tier 3: step 1.5000 s"):
        choose_tiers([_rank(0, None), _rank(1, None, slowdown=5.0)])


def test_rank_0_must_fit_tier_0():
    with pytest.raises(ValueError, match="rank 0 must train tier 0"):
        choose_tiers([_rank(0, 6 * GIB), _rank(1, None)])  # rank 1 fits tier 0, so there is a reference
    with pytest.raises(ValueError, match="no rank fits tier 0"):
        choose_tiers([_rank(0, 6 * GIB), _rank(1, 6 * GIB)])
    with pytest.raises(ValueError, match="put the fastest node"):
        choose_tiers([_rank(0, None, slowdown=1.5), _rank(1, None)])  # rank 0 1.5 s vs rank 1's 1.0 s


def test_not_probed_tier_is_reported_as_such():
    with pytest.raises(ValueError, match=r"tier 0: not probed \(predicted over the limit\)"):
        choose_tiers([_rank(0, None), _rank(1, GIB, skip_over=GIB)])


def test_per_ffn_mixing_interpolates_between_adjacent_tiers():
    # Budget 5.85 GiB at a 6.5 GiB limit: tier 1 fits (5), tier 0 (8) does not. Interpolated peak with k of 4 FFNs at
    # tier 0: 5 + 3k/4 GiB -> k = 1 (5.75 GiB) fits, k = 2 (6.5) does not.
    choice = choose_tiers([_rank(0, None), _rank(1, int(6.5 * GIB))], num_layers=4)
    assert choice.per_rank == [0, [0, 1, 1, 1]]
    assert "(estimated)" in choice.lines[1]
    # Without mixing: the uniform tier.
    assert choose_tiers([_rank(0, None), _rank(1, int(6.5 * GIB))]).per_rank == [0, 1]
    # Nothing mixable when even one wider FFN misses: stays uniform.
    assert choose_tiers([_rank(0, None), _rank(1, int(5.6 * GIB))], num_layers=4).per_rank == [0, 1]


def test_identical_input_gives_identical_output():
    measurements = [_rank(0, None), _rank(1, 7 * GIB, slowdown=1.3), _rank(2, 5 * GIB, slowdown=2.0)]
    first = choose_tiers(measurements)
    again = choose_tiers([TierMeasurement.from_json(json.loads(json.dumps(m.to_json())), m.rank) for m in measurements])
    assert first == again
    assert json.dumps(first.to_json()) == json.dumps(again.to_json())


def test_json_round_trip_and_refusals():
    measurement = _rank(1, 7 * GIB, skip_over=6 * GIB)
    assert TierMeasurement.from_json(json.loads(json.dumps(measurement.to_json())), 1) == measurement
    document = measurement.to_json()
    with pytest.raises(ValueError, match="names rank 1"):
        TierMeasurement.from_json(document, 2)
    bad = json.loads(json.dumps(document))
    bad["tiers"]["1"]["step_seconds"] = -1.0
    with pytest.raises(ValueError, match="step_seconds=-1.0"):
        TierMeasurement.from_json(bad, 1)
    bad = json.loads(json.dumps(document))
    bad["tiers"]["x"] = bad["tiers"].pop("1")
    with pytest.raises(ValueError, match="tier key 'x'"):
        TierMeasurement.from_json(bad, 1)
    with pytest.raises(ValueError, match="memory_limit_bytes"):
        TierMeasurement.from_json({**document, "memory_limit_bytes": "lots"}, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_slowdown": 0.9}, "max_slowdown"),
        ({"memory_headroom": 1.0}, "memory_headroom"),
        ({"num_layers": 0}, "num"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        choose_tiers([_rank(0, None)], **kwargs)


def test_measurements_must_be_in_rank_order():
    with pytest.raises(ValueError, match="rank order"):
        choose_tiers([_rank(1, None), _rank(0, None)])
