"""The module that takes the place of the user's model and holds only this rank's pipeline stage.

Shared by the subspace pipeline (:class:`~lightning_hetero.subspace_pipeline.container.PipelineStageModel`) and
layerwise training (:class:`~lightning_hetero.layerwise.dgl_stage.DGLStageModel`). Its parameters are the stage's, so
``configure_optimizers`` (``self.parameters()``) sees only this rank's share of the model. Calling it is an error:
the strategy runs the stage. Nothing here imports Lightning.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from torch import nn

__all__ = ["StageHolder", "find_stage_holder"]

HolderT = TypeVar("HolderT", bound="StageHolder")


class StageHolder(nn.Module):
    """Holds one stage of a pipeline in place of the user's model; subclasses register the stage's modules.

    Args:
        config: The original model's config, if any (kept for code that reads ``model.config``).
        stage_index: Index of the stage.
        num_stages: Number of stages.
    """

    pipeline_name: ClassVar[str] = "pipeline"
    """Named in the error of a call, e.g. ``"SubspacePipelineStrategy"``."""
    how_to_run: ClassVar[str] = "The strategy runs it."
    """The end of the error of a call: how to run the stage instead."""

    def __init__(self, config: Any, stage_index: int, num_stages: int) -> None:
        super().__init__()
        self.config = config
        self.stage_index = stage_index
        self.num_stages = num_stages

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"This model is stage {self.stage_index} of a {self.num_stages}-stage {self.pipeline_name} pipeline; it "
            f"cannot run on its own. {self.how_to_run}"
        )


def find_stage_holder(module: nn.Module, kind: type[HolderT]) -> HolderT | None:
    """The ``kind`` holder inside ``module`` (or ``module`` itself), if a setup already put one there."""
    for sub in module.modules():
        if isinstance(sub, kind):
            return sub
    return None
