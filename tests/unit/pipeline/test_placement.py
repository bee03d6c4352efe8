"""The pipeline runtimes' shared placement: world check, replica-only sampling, and a clear error before setup."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.core import WorldLayout
from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
from lightning_hetero.layerwise.settings import LayerwiseSettings
from lightning_hetero.pipeline.layout import PipelinePlacement
from lightning_hetero.pipeline.settings import PipelineSettings
from lightning_hetero.subspace_pipeline.runtime import SubspacePipelineRuntime
from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings

PIPELINE = PipelineSettings(num_stages=2, data_parallel_size=3)
RUNTIMES = [
    lambda: DecoupledRuntime(LayerwiseSettings(pipeline=PIPELINE), owner="LayerwiseStrategy"),
    lambda: SubspacePipelineRuntime(SubspacePipelineSettings(pipeline=PIPELINE), owner="SubspacePipelineStrategy"),
]


@pytest.mark.parametrize("build", RUNTIMES, ids=["layerwise", "subspace"])
def test_both_pipeline_runtimes_share_one_placement(build) -> None:
    runtime = build()
    assert isinstance(runtime, PipelinePlacement)
    assert (runtime.num_stages, runtime.data_parallel_size) == (2, 3)
    runtime.resolve_launch(WorldLayout(1, 6))  # 2 stages x 3 replicas
    with pytest.raises(ValueError, match=runtime.owner):
        runtime.resolve_launch(WorldLayout(1, 4))
    # stage-major: global rank r is replica r % 3; every stage of a replica reads the same batches
    assert [runtime.sampler_kwargs(rank) for rank in (0, 4)] == [
        {"num_replicas": 3, "rank": 0},
        {"num_replicas": 3, "rank": 1},
    ]
    for view in ("stage_index", "dp_rank", "is_first", "is_last", "stage"):
        with pytest.raises(RuntimeError, match=f"{runtime.owner}: the pipeline is not set up yet"):
            getattr(runtime, view)


def test_a_stage_holder_refuses_to_run_and_a_runtime_refuses_a_holder_of_another_pipeline() -> None:
    from torch import nn

    from lightning_hetero.layerwise.dgl_stage import DGLStageModel
    from lightning_hetero.pipeline.stage_holder import StageHolder, find_stage_holder
    from lightning_hetero.subspace_pipeline.container import PipelineStageModel

    holders = [
        DGLStageModel(None, nn.Linear(2, 2), nn.Linear(2, 2), 1, 3, None),
        PipelineStageModel(nn.Linear(2, 2), None, 1, 3),
    ]
    for holder, build in zip(holders, RUNTIMES, strict=True):
        assert isinstance(holder, StageHolder)
        with pytest.raises(RuntimeError, match="stage 1 of a 3-stage .* pipeline; it cannot run on its own"):
            holder(None)
        assert find_stage_holder(nn.Sequential(nn.Linear(1, 1), holder), type(holder)) is holder
        runtime = build()  # a 2-stage pipeline
        with pytest.raises(ValueError, match=r"num_stages=2, but the module already holds stage 1 of a 3-stage"):
            runtime.setup(nn.Sequential(holder), torch.device("cpu"), 1)  # rank 1 sends no loss report
