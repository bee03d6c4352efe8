"""The operating point R and its projection helpers (recipes/common/operating_point.py): exact arithmetic and clear
errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "recipes" / "common"))

from operating_point import (  # noqa: E402
    PROJECTION_MODELS,
    ModelShape,
    allreduce_link_bytes,
    link_seconds,
    operating_point,
    physical_limit_ratio,
    project_operating_point,
    training_flops_per_step,
)


def test_link_seconds_is_bits_over_rate() -> None:
    assert link_seconds(12_500_000, "100mbit") == pytest.approx(1.0)
    assert link_seconds(0, "20mbit") == 0.0


def test_operating_point_ratio_and_fields() -> None:
    point = operating_point(25_000_000, "20mbit", compute_seconds=0.5)
    assert point.link_s == pytest.approx(10.0)
    assert point.ratio == pytest.approx(20.0)
    assert point.bandwidth_bits_per_s == 20e6
    assert point.as_dict()["ratio"] == 20.0


@pytest.mark.parametrize("compute", [0.0, -1.0, float("nan"), float("inf")])
def test_operating_point_rejects_bad_compute(compute: float) -> None:
    with pytest.raises(ValueError, match="compute_seconds"):
        operating_point(1000, "100mbit", compute)


def test_link_seconds_rejects_negative_bytes_and_bad_rate() -> None:
    with pytest.raises(ValueError, match="bytes_per_step"):
        link_seconds(-1, "100mbit")
    with pytest.raises(ValueError):
        link_seconds(1, "fast")


def test_physical_limit_ratio_takes_the_slower_resource() -> None:
    # 12.5 MB at 100 Mbit = 1 s of wire; compute 0.25 s: the wire is the bound.
    assert physical_limit_ratio(1.2, 0.25, 12_500_000, "100mbit") == pytest.approx(1.2)
    # Compute-bound: 2 s compute, 0.1 s wire.
    assert physical_limit_ratio(2.0, 2.0, 1_250_000, "100mbit") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="both zero"):
        physical_limit_ratio(1.0, 0.0, 0, "100mbit")


def test_allreduce_bytes_follow_the_ring_formula() -> None:
    assert allreduce_link_bytes(1000, 4, 2) == 4000.0
    assert allreduce_link_bytes(1000, 4, 4) == 6000.0
    with pytest.raises(ValueError, match="num_nodes"):
        allreduce_link_bytes(1000, 4, 1)


def test_training_flops() -> None:
    assert training_flops_per_step(10, 2, 4, 8, 100) == 6 * 10 * 100 + 6 * 2 * 8 * 4 * 100


def test_projection_of_a_known_shape() -> None:
    shape = ModelShape("toy", params=1_000_000, matmul_params=1_000_000, num_layers=1, hidden_size=1)
    row = project_operating_point(shape, tokens_per_step=1, seq_len=1, bandwidth=8e6, flops_per_second=6e6 + 6)
    # 4 MB each way at 1 MB/s = 4 s of wire; 6e6 + 6 FLOPs at that rate = 1 s of compute.
    assert row["link_s"] == pytest.approx(4.0)
    assert row["compute_s"] == pytest.approx(1.0)
    assert row["ratio"] == pytest.approx(4.0)


def test_projection_models_are_consistent() -> None:
    for shape in PROJECTION_MODELS:
        assert 0 < shape.matmul_params <= shape.params
