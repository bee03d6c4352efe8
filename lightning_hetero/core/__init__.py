"""What every strategy runtime needs, framework-free: the launch layout, the runtime interface the Lightning adapters
drive, initial-state broadcast, distributed gradient-norm clipping and directory checkpoint files.

Nothing here imports Lightning; :mod:`lightning_hetero.strategies.lifecycle` adapts it to the Trainer and Fabric.
"""

from lightning_hetero.core.checkpoint_dir import (
    CorruptCheckpointError,
    load_part,
    part_file,
    remove_checkpoint,
    write_part,
)
from lightning_hetero.core.runtime import StrategyRuntime, WorldLayout, process_rank_and_size
from lightning_hetero.core.state import (
    all_gather_json,
    average_gradients,
    broadcast_module_state,
    clip_grad_norm_over_group,
)

__all__ = [
    "CorruptCheckpointError",
    "StrategyRuntime",
    "WorldLayout",
    "all_gather_json",
    "average_gradients",
    "broadcast_module_state",
    "clip_grad_norm_over_group",
    "load_part",
    "part_file",
    "process_rank_and_size",
    "remove_checkpoint",
    "write_part",
]
