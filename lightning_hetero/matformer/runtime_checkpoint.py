"""The checkpoint side of tiered MatFormer training (a mixin of the runtime).

- ``mode="demo"``: every rank's error-feedback buffers travel in rank 0's checkpoint (gathered at save, each rank's
  own part restored at load, or kept until ``setup`` builds the exchange);
- sliced tier ranks load rank 0's full checkpoint cut to their FFN widths (model and optimizer state).

:class:`~lightning_hetero.matformer.runtime.MatFormerRuntime` mixes this in; nothing here imports Lightning.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hetero.matformer.checkpoint import slice_model_state, slice_optimizer_state
from lightning_hetero.matformer.compressed import CompressedExchange
from lightning_hetero.matformer.types import FFNParameter

__all__ = ["RuntimeCheckpoints"]


class RuntimeCheckpoints:
    """Extra checkpoint state (DeMo buffers) and the slicing of full checkpoints for sliced ranks.

    The host class sets the attributes below (the runtime does in ``__init__`` and ``setup``).
    """

    owner: str
    mode: str
    exchange: CompressedExchange | None
    _pending_exchange_state: dict[str, Tensor] | None
    sliced: bool
    ffn_params: list[FFNParameter]
    local_widths: list[int]

    def extra_checkpoint_state(self, device: torch.device) -> dict[str, Any] | None:
        """``mode="demo"``: every rank's error-feedback buffers, on rank 0 (collective; None elsewhere or off)."""
        if self.exchange is None:
            return None
        ranks = self.exchange.gather_state(device)
        return None if ranks is None else {"world_size": len(ranks), "ranks": ranks}

    def load_extra_checkpoint_state(self, entry: Mapping[str, Any] | None) -> None:
        """``mode="demo"``: restore this rank's buffers from a checkpoint entry (applied at setup if not set up yet).

        A checkpoint without the entry (saved in another mode) or from another world size resets them to zero, with
        a warning: training goes on, but not bit-identically.
        """
        if self.mode != "demo":
            return
        initialized = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if initialized else (1, 0)
        if entry is None or int(entry.get("world_size", -1)) != world:
            found = "no error-feedback buffers" if entry is None else f"buffers of {entry.get('world_size')} ranks"
            warnings.warn(
                f"{self.owner}(mode='demo'): the checkpoint holds {found} for this {world}-rank run; the"
                " error-feedback buffers start from zero (the resumed run is not bit-identical).",
                stacklevel=2,
            )
            state: dict[str, Tensor] = {}
        else:
            state = dict(entry["ranks"][rank])
        if self.exchange is None:
            self._pending_exchange_state = state
        else:
            self.exchange.load_state_dict(state)

    def slice_model_state(self, state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """A full model state dict cut to this rank's widths (unchanged when this rank is not sliced)."""
        return slice_model_state(state, self.ffn_params, self.local_widths) if self.sliced else state

    def slice_optimizer_state(self, state: Mapping[str, Any], optimizer: Optimizer, module: nn.Module) -> Any:
        """Rank 0's optimizer state cut to this rank's sliced parameters (unchanged when this rank is not sliced)."""
        return slice_optimizer_state(state, optimizer, module, self.ffn_params) if self.sliced else state
