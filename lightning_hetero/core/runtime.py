"""The interface between a strategy's framework-free runtime and its Lightning Trainer and Fabric adapters.

Every strategy keeps its logic in one runtime object (``FlexDeMoRuntime``, ``MatFormerRuntime``,
``SubspacePipelineRuntime``, ...). The adapters in :mod:`lightning_hetero.strategies` only decide *when* it runs, and
they all drive it through the members of :class:`StrategyRuntime`: the launch check, the no-sync scope of gradient
accumulation, clipping, extra checkpoint state, directory checkpoints and teardown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hetero.core.checkpoint_dir import load_part

__all__ = ["StrategyRuntime", "WorldLayout", "process_rank_and_size"]


@dataclass(frozen=True)
class WorldLayout:
    """How the processes are launched: ``num_nodes`` nodes of ``ranks_per_node`` processes each."""

    num_nodes: int
    ranks_per_node: int

    @property
    def world_size(self) -> int:
        """Processes in the job."""
        return self.num_nodes * self.ranks_per_node


def process_rank_and_size() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class StrategyRuntime:
    """Base of the strategy runtimes: what the Lightning adapters call, with neutral defaults.

    Subclasses set :attr:`owner` (the strategy's class name, used in messages) and implement :meth:`resolve_launch`
    and :meth:`clip_grad_norm_`. Strategies whose checkpoint is a directory of per-rank files set
    :attr:`directory_checkpoint` and implement the four ``checkpoint_*`` members.
    """

    owner: str = "Strategy"
    checkpoint_key: ClassVar[str] = "lightning_hetero_runtime"
    """Key of :meth:`extra_checkpoint_state` inside a checkpoint."""
    directory_checkpoint: ClassVar[bool] = False
    """True: a checkpoint is a directory with a part file per writing rank plus a metadata file."""
    restore_after_setup: ClassVar[bool] = False
    """True: a checkpoint holds what setup makes of the model (shards, stages, codes), so it is restored after."""

    def _attach_settings(self, settings: Any, settings_class: type, owner: str) -> None:
        """Keep ``settings`` and ``owner`` (what every runtime's ``__init__`` starts with).

        Raises:
            TypeError: ``settings`` is not a ``settings_class`` (e.g. a dict from a hand-written YAML), naming both.
        """
        if not isinstance(settings, settings_class):
            name = settings_class.__name__
            raise TypeError(f"{owner}: settings={settings!r} is not a {name}; pass settings={name}(...).")
        self.settings = settings
        self.owner = owner

    # ------------------------------------------------------------------------------------------------ launch
    def resolve_launch(self, world: WorldLayout) -> None:
        """Check the strategy's arguments against the launch layout, before any process starts (raise if wrong)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ training
    def set_sync_blocked(self, blocked: bool) -> None:
        """Called when a gradient-accumulation scope (no synchronization) starts (True) and ends (False)."""

    def clip_grad_norm_(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the gradients of ``parameters`` with the strategy's definition of the norm; returns the norm."""
        raise NotImplementedError

    def teardown(self) -> None:
        """Release hooks and per-fit state at the end of a fit (the module stays as set up)."""

    # ------------------------------------------------------------------------------------------------ checkpoints
    def extra_checkpoint_state(self, device: torch.device) -> dict[str, Any] | None:
        """State the runtime adds to this rank's checkpoint (may be collective: every rank calls it); None: none."""
        return None

    def load_extra_checkpoint_state(self, entry: Mapping[str, Any] | None) -> None:
        """Restore what :meth:`extra_checkpoint_state` saved (``None`` when the checkpoint holds nothing)."""

    def checkpoint_part(self, global_rank: int) -> str | None:
        """Directory checkpoints: the part this rank writes (a file name without ``.pt``), or None."""
        raise NotImplementedError

    def checkpoint_part_to_load(self, global_rank: int) -> str:
        """Directory checkpoints: the part this rank restores from."""
        raise NotImplementedError

    def write_checkpoint_meta(self, directory: Path) -> None:
        """Directory checkpoints: write the metadata file (global rank 0 only)."""
        raise NotImplementedError

    def check_checkpoint_meta(self, directory: Path) -> None:
        """Directory checkpoints: raise a clear error if ``directory`` cannot resume this run."""
        raise NotImplementedError

    def load_checkpoint_part(self, directory: Path, global_rank: int, map_location: Any = "cpu") -> dict[str, Any]:
        """Directory checkpoints: what this rank restores (checked with :meth:`check_checkpoint_meta` first).

        The default loads :meth:`checkpoint_part_to_load`; a strategy that can resume on another world size
        overrides it to rebuild the part from the saved ones (FlexDeMo re-cuts its shards).
        """
        self.check_checkpoint_meta(directory)
        return load_part(directory, self.checkpoint_part_to_load(global_rank), map_location=map_location)
