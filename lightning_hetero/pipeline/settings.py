"""The settings every pipeline strategy shares: how many stages, how many replicas, what a boundary carries.

:class:`PipelineSettings` is a field (``pipeline``) of both
:class:`~lightning_hetero.subspace_pipeline.settings.SubspacePipelineSettings` and
:class:`~lightning_hetero.layerwise.settings.LayerwiseSettings`, so these are declared (and documented) once. What
only one method has (the subspace pipeline's schedule and micro-batches, layerwise's block boundaries and replay
buffer) stays in that method's settings: a DGL stage never runs backward across a boundary, so it has no schedule.
Nothing here imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_hetero.core.settings import check_choice, check_int

__all__ = ["BOUNDARY_DTYPES", "BoundaryDtype", "PipelineSettings", "check_pipeline_field"]

BOUNDARY_DTYPES: tuple[str, ...] = ("fp32", "bf16", "int8")
"""Codecs of :class:`~lightning_hetero.pipeline.boundary_codec.BoundaryCodec`."""
BoundaryDtype = Literal["fp32", "bf16", "int8"]


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """How the ranks form the pipeline, and the codec of what crosses a stage boundary.

    Global rank ``r`` runs stage ``r // data_parallel_size`` of replica ``r % data_parallel_size`` (stage-major), so
    a stage's replicas share a node and only boundary tensors cross the links between nodes.

    Attributes:
        num_stages: Pipeline stages ``P``, one per rank of a replica; the world must have
            ``num_stages * data_parallel_size`` processes.
        data_parallel_size: Replicas ``D`` of every stage. A stage's gradients are averaged over its replicas, and
            the data is sharded over replicas only (every stage of a replica reads the same batches).
        boundary_dtype: Codec of the tensors crossing a stage boundary: ``"fp32"`` (exact), ``"bf16"`` (half the
            bytes) or ``"int8"`` (lossy: one float32 scale per token).
    """

    num_stages: int = 2
    data_parallel_size: int = 1
    boundary_dtype: BoundaryDtype = "fp32"

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int(owner, "num_stages", self.num_stages, minimum=1)
        check_int(owner, "data_parallel_size", self.data_parallel_size, minimum=1)
        check_choice(owner, "boundary_dtype", self.boundary_dtype, BOUNDARY_DTYPES)


def check_pipeline_field(owner: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is a :class:`PipelineSettings` (what the ``pipeline`` field must hold)."""
    if not isinstance(value, PipelineSettings):
        raise TypeError(
            f"{owner}.pipeline={value!r}: use PipelineSettings(num_stages=..., data_parallel_size=..., "
            "boundary_dtype=...) (in YAML: `settings: {pipeline: {num_stages: 2}}`)."
        )
