"""Pieces every lightning-hetero strategy shares: process-group cleanup at exit and runtime-defined clipping.

Each strategy keeps its logic in a framework-free ``runtime`` object shared by its Trainer and Fabric classes; the
Fabric classes derive from :class:`RuntimeFabricDDPStrategy` so that ``fabric.clip_gradients`` uses the runtime's
definition of the gradient norm (the full model's norm for MatFormer, the node's norm for FlexDeMo, the norm over
all pipeline stages for the subspace pipeline) instead of each rank's local norm.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["RuntimeFabricDDPStrategy", "destroy_process_group_at_exit"]

_CLEANUP_REGISTERED = False


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit, in every process, whatever the backend.

    Lightning registers this only for NCCL. Under gloo, a process that exits with its group alive can abort
    (``terminate called without an active exception``, SIGABRT): gloo's worker threads may still hold finished works
    whose tensors are released during interpreter finalization. Seen in about 1 of 10 spawned fits here.
    """
    global _CLEANUP_REGISTERED
    if not _CLEANUP_REGISTERED:
        atexit.register(_destroy_process_group)
        _CLEANUP_REGISTERED = True


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class RuntimeFabricDDPStrategy(DDPStrategy):
    """Fabric ``DDPStrategy`` whose gradient clipping is delegated to ``self.runtime.clip_grad_norm_``.

    Subclasses set ``self.runtime`` to an object with ``clip_grad_norm_(parameters, max_norm, norm_type,
    error_if_nonfinite) -> Tensor`` before training starts.
    """

    runtime: Any

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self.precision.unscale_gradients(optimizer)
        parameters = self.precision.main_params(optimizer)
        return self.runtime.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)
