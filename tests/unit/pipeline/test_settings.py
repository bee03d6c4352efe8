"""``PipelineSettings``: what both pipeline strategies share, each field checked once, naming it."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from lightning_hetero.pipeline.boundary_codec import BoundaryCodec
from lightning_hetero.pipeline.settings import BOUNDARY_DTYPES, BoundaryDtype, PipelineSettings


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_stages": 0}, r"PipelineSettings\.num_stages=0: use an int >= 1"),
        ({"data_parallel_size": 0}, r"PipelineSettings\.data_parallel_size=0: use an int >= 1"),
        ({"boundary_dtype": "fp8"}, r"PipelineSettings\.boundary_dtype='fp8': use one of"),
    ],
)
def test_pipeline_fields_name_their_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineSettings(**kwargs)


def test_defaults_and_frozen() -> None:
    settings = PipelineSettings()
    assert (settings.num_stages, settings.data_parallel_size, settings.boundary_dtype) == (2, 1, "fp32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.num_stages = 4  # type: ignore[misc]


@pytest.mark.parametrize("dtype", BOUNDARY_DTYPES)
def test_every_boundary_dtype_is_a_codec(dtype: str) -> None:
    BoundaryCodec(dtype, 8)  # every choice the settings accept is a codec that exists
    assert set(typing.get_args(BoundaryDtype)) == set(BOUNDARY_DTYPES)  # and the CLI's Literal lists the same
