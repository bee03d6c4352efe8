"""Which rank runs which pipeline stage, the process groups that follow from it, and the balanced stage split.

One stage per rank. Global rank ``r`` of a world of ``num_stages * data_parallel_size`` ranks runs stage
``r // data_parallel_size`` of replica ``r % data_parallel_size`` (stage-major, like Megatron's outermost pipeline
dimension): with ``data_parallel_size`` processes per node, as the Trainer (``devices`` per node) and the bandwidth
testbed (``--ranks-per-node``) number ranks, each node holds exactly one stage and all its replicas, so the
replicas' gradient average stays inside a node and only boundary messages cross the slow links between nodes.

Shared by the subspace pipeline and decoupled layerwise training. Nothing here imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_hetero.core.runtime import WorldLayout
    from lightning_hetero.pipeline.stage_holder import StageHolder

__all__ = ["PipelineGroups", "PipelineLayout", "PipelinePlacement", "split_layers"]


@dataclass(frozen=True)
class PipelineLayout:
    """Which global rank runs which stage of which replica (stage-major: ``rank = stage * dp_size + dp_rank``)."""

    num_stages: int
    data_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        """``num_stages * data_parallel_size``."""
        return self.num_stages * self.data_parallel_size

    def stage_of(self, rank: int) -> int:
        """The stage run by global ``rank``."""
        return rank // self.data_parallel_size

    def dp_rank_of(self, rank: int) -> int:
        """The replica (data-parallel rank) of global ``rank``."""
        return rank % self.data_parallel_size

    def global_rank(self, stage: int, dp_rank: int) -> int:
        """The global rank running ``stage`` of replica ``dp_rank``."""
        return stage * self.data_parallel_size + dp_rank

    def pipeline_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of replica ``dp_rank``'s pipeline, in stage order."""
        return [self.global_rank(stage, dp_rank) for stage in range(self.num_stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """Global ranks holding ``stage`` (one per replica), in replica order."""
        return [self.global_rank(stage, dp_rank) for dp_rank in range(self.data_parallel_size)]

    def check_world(self, world_size: int, owner: str = "SubspacePipelineStrategy") -> None:
        """Raise a ValueError naming both numbers unless ``world_size == num_stages * data_parallel_size``."""
        if world_size != self.world_size:
            raise ValueError(
                f"{owner}: the world has {world_size} processes but num_stages={self.num_stages} x "
                f"data_parallel_size={self.data_parallel_size} needs {self.world_size}. Launch "
                f"{self.world_size} processes (e.g. Trainer(num_nodes={self.num_stages}, "
                f"devices={self.data_parallel_size})) or change num_stages / data_parallel_size."
            )


class PipelineGroups:
    """This rank's pipeline group (its replica's stages) and data-parallel group (its stage's replicas).

    Every rank creates every group, in the same order (``dist.new_group`` is collective over the world).

    Args:
        layout: The rank layout.
        rank: This process's global rank.
    """

    def __init__(self, layout: PipelineLayout, rank: int) -> None:
        self.layout = layout
        self.rank = rank
        self.stage = layout.stage_of(rank)
        self.dp_rank = layout.dp_rank_of(rank)
        initialized = dist.is_available() and dist.is_initialized()
        self.pipeline_group: Any | None = None
        self.dp_group: Any | None = None
        if initialized and layout.world_size > 1:
            for dp_rank in range(layout.data_parallel_size):
                group = dist.new_group(layout.pipeline_ranks(dp_rank))
                if dp_rank == self.dp_rank:
                    self.pipeline_group = group
            for stage in range(layout.num_stages):
                group = dist.new_group(layout.replica_ranks(stage))
                if stage == self.stage:
                    self.dp_group = group
        ranks = layout.pipeline_ranks(self.dp_rank)
        self.pipeline_ranks = ranks
        self.prev_rank = ranks[self.stage - 1] if self.stage > 0 else None
        self.next_rank = ranks[self.stage + 1] if self.stage < layout.num_stages - 1 else None
        self.last_rank = ranks[-1]
        """Global rank of this replica's last stage (it computes the loss)."""
        self.first_rank = ranks[0]


class PipelinePlacement:
    """Where a pipeline runtime's rank sits: the world check, replica-only sampling and the views of ``groups``.

    Mixed into the runtimes of the subspace pipeline and of layerwise training, which set :attr:`owner` (named in
    errors), :attr:`layout` in ``__init__`` and :attr:`groups` in ``setup``. The views raise a clear error before
    ``setup``.
    """

    owner: str
    layout: PipelineLayout
    groups: PipelineGroups | None = None

    @property
    def num_stages(self) -> int:
        """``P``."""
        return self.layout.num_stages

    @property
    def data_parallel_size(self) -> int:
        """``D``."""
        return self.layout.data_parallel_size

    def resolve_launch(self, world: WorldLayout) -> None:
        """Check the world size against ``num_stages * data_parallel_size`` (raises before any process starts)."""
        self.layout.check_world(world.world_size, self.owner)

    def sampler_kwargs(self, global_rank: int) -> dict[str, int]:
        """DistributedSampler arguments: every stage of a replica reads the same batches (shard by replica only)."""
        return {"num_replicas": self.data_parallel_size, "rank": self.layout.dp_rank_of(global_rank)}

    def _check_holder(self, existing: StageHolder) -> None:
        """Refuse a module whose stage (from an earlier setup) belongs to a pipeline of another length."""
        if existing.num_stages != self.num_stages:
            raise ValueError(
                f"{self.owner}: settings.pipeline.num_stages={self.num_stages}, but the module already holds stage "
                f"{existing.stage_index} of a {existing.num_stages}-stage pipeline."
            )

    def _not_set_up(self) -> RuntimeError:
        return RuntimeError(f"{self.owner}: the pipeline is not set up yet (the strategy does it in setup).")

    @property
    def _groups(self) -> PipelineGroups:
        if self.groups is None:
            raise self._not_set_up()
        return self.groups

    @property
    def stage_index(self) -> int:
        """This rank's stage."""
        return self._groups.stage

    @property
    def dp_rank(self) -> int:
        """This rank's replica."""
        return self._groups.dp_rank

    @property
    def is_first(self) -> bool:
        """This rank runs the first stage."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """This rank runs the last stage."""
        return self.stage_index == self.num_stages - 1


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Balanced contiguous ``[start, stop)`` layer ranges, earlier stages taking the remainder.

    Raises:
        ValueError: ``num_stages`` < 1 or > ``num_layers``.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be a positive integer.")
    if num_stages > num_layers:
        raise ValueError(
            f"num_stages={num_stages} exceeds the model's {num_layers} decoder layers; every stage needs at least "
            f"one layer, so use num_stages <= {num_layers}."
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        stop = start + base + (1 if stage < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
