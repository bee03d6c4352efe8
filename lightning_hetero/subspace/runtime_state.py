"""What the subspace pipeline runtime saves and exports: checkpoint metadata and parts, extra state, dense export.

A mixin of :class:`~lightning_hetero.subspace.runtime.SubspacePipelineRuntime`, kept apart from the step logic.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_hetero.pipeline.stage_gather import gather_stage_states, stage_bytes_limit
from lightning_hetero.subspace import checkpoint as ckpt

__all__ = ["PipelineStateMixin"]


class PipelineStateMixin:
    """Checkpoint and export members of the pipeline runtime (uses its ``config``, ``layout``, ``stage``, ...)."""

    # Provided by SubspacePipelineRuntime.
    config: Any
    container: Any
    layer_ranges: list[tuple[int, int]] | None
    layout: Any
    n_microbatches: int
    schedule: str
    steps: int
    subspace_updates: int
    num_stages: int
    data_parallel_size: int
    stage_index: int
    dp_rank: int
    stage: Any
    stage_device: torch.device
    _groups: Any

    def meta(self) -> dict[str, Any]:
        """What a checkpoint records about the pipeline (checked on resume)."""
        hf_config = self.container.config if self.container is not None else None
        hidden = getattr(hf_config, "hidden_size", None)
        rank = self.config.resolve_rank(hidden) if self.config.compress and hidden else None
        return {
            "num_stages": self.num_stages,
            "data_parallel_size": self.data_parallel_size,
            "layer_ranges": [list(r) for r in self.layer_ranges] if self.layer_ranges else None,
            "rank": rank,
            "compress": self.config.compress,
            "mode": self.config.mode,
            "seed": self.config.seed,
            "coord_dtype": self.config.coord_dtype,
            "update_every": self.config.update_every,
            "schedule": self.schedule,
            "n_microbatches": self.n_microbatches,
            "model_type": getattr(hf_config, "model_type", None),
        }

    def extra_checkpoint_state(self, device: torch.device) -> dict[str, Any]:
        return {"steps": self.steps, "subspace_updates": self.subspace_updates}

    def load_extra_checkpoint_state(self, entry: Mapping[str, Any] | None) -> None:
        entry = entry or {}
        self.steps = int(entry.get("steps", 0))
        self.subspace_updates = int(entry.get("subspace_updates", 0))

    def checkpoint_part(self, global_rank: int) -> str | None:
        return ckpt.stage_file(".", self.stage_index).stem if self.dp_rank == 0 else None

    def checkpoint_part_to_load(self, global_rank: int) -> str:
        return ckpt.stage_file(".", self.stage_index).stem

    def write_checkpoint_meta(self, directory: Path) -> None:
        ckpt.write_meta(directory, self.meta())

    def check_checkpoint_meta(self, directory: Path) -> None:
        ckpt.check_meta(ckpt.read_meta(directory), self.meta(), directory)

    def gather_stage_states(self) -> list[dict[str, Tensor]] | None:
        """Every stage's ``state_dict`` (replica 0's), in stage order, on global rank 0; None elsewhere (collective)."""
        state = {k: v.detach().cpu() for k, v in self.stage.state_dict().items()}
        # Rank 0 bounds every announced stage size by what this model's stages can hold, before allocating.
        bound = (
            stage_bytes_limit(self.container.config) if self._groups.rank == 0 and self.container is not None else None
        )
        return gather_stage_states(state, self.layout, self._groups.rank, self.stage_device, max_bytes=bound)

    def export_dense(self, path: str, tokenizer: Any | None = None) -> str | None:
        """Write the whole pipeline as one plain HF checkpoint at ``path`` (collective; rank 0 writes).

        Returns ``path`` on global rank 0, None elsewhere.
        """
        states = self.gather_stage_states()
        if states is None:
            return None
        from lightning_hetero.subspace.export import export_dense

        assert self.container is not None
        export_dense(states, self.container.config, path, tokenizer=tokenizer, subspace_config=self.config)
        return path
