"""Where the pipeline stage lives inside the user's module: the stage container and the decoder's location."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_hetero.hf.decoder import find_decoder
from lightning_hetero.pipeline.stage_holder import StageHolder
from lightning_hetero.subspace_pipeline.layers import CONFINED_WRITER_TYPES

__all__ = ["PipelineStageModel", "hollow_into", "locate_decoder"]


class PipelineStageModel(StageHolder):
    """Takes the place of the user's HF model inside their module: holds only this rank's stage.

    Its parameters are the stage's, so ``configure_optimizers`` (``self.parameters()``) builds an optimizer over this
    rank's share of the model. Calling it directly is an error: the strategy drives the stage through the schedule.

    Args:
        stage: This rank's stage module.
        config: The HF config of the original model (kept for code that reads ``model.config``).
        stage_index: Index of the stage.
        num_stages: Number of stages.
    """

    pipeline_name = "SubspacePipelineStrategy"
    how_to_run = (
        "The strategy runs the schedule for you (Trainer), or call strategy.train_step(batch) / "
        "strategy.eval_step(batch) (Fabric). Export the whole model with strategy.export_dense(path)."
    )

    def __init__(self, stage: nn.Module, config: Any, stage_index: int, num_stages: int) -> None:
        super().__init__(config, stage_index, num_stages)
        self.stage = stage


def hollow_into(module: nn.Module, container: PipelineStageModel) -> None:
    """Make ``container`` the only content of ``module`` (the bare HF model): its own modules, parameters and buffers
    go, its ``forward`` becomes the container's (which explains how to run the pipeline)."""
    for registry in (module._modules, module._parameters, module._buffers):
        registry.clear()
    module.pipeline = container
    module.forward = container.forward  # type: ignore[method-assign]


def locate_decoder(module: nn.Module) -> tuple[nn.Module | None, str, nn.Module]:
    """``(parent, attribute, hf_model)``: the supported HF causal LM inside ``module`` and where it hangs.

    ``parent`` is None when ``module`` is the HF model itself.

    Raises:
        ValueError: No supported model inside (the subspace core's message names the supported families).
    """
    parts = find_decoder(module, CONFINED_WRITER_TYPES)
    if not parts.path:
        return None, "", parts.causal_lm
    parent_name, _, attribute = parts.path.rpartition(".")
    return module.get_submodule(parent_name), attribute, parts.causal_lm
