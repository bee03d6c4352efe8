"""What the ``sparseflip`` runtime keeps across a restart, and its memory accounting.

A mixin of :class:`~lightning_hetero.lowbit.runtime.SparseFlipRuntime`: the step counter, the deciding rank's rule
state, every rank's Bop momenta and residuals (gathered into rank 0's checkpoint and handed back to their ranks).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_hetero import comm
from lightning_hetero.core import process_rank_and_size

__all__ = ["CHECKPOINT_LABEL", "SparseFlipStateMixin"]

CHECKPOINT_LABEL = "checkpoint"
"""Ledger label of gathering the fp residuals into rank 0's checkpoint."""


class SparseFlipStateMixin:
    """Checkpoint and accounting members of the sparseflip runtime (uses its exchange, rule, layout, ...)."""

    # Provided by SparseFlipRuntime.
    aggregation: str
    server: int
    steps: int
    kind: str
    error_feedback: bool
    exchange: Any
    rule: Any
    local_bop: Any
    fp_sync: Any
    layout: Any
    module: Any
    code_residual: Tensor | None
    _pending_entry: Mapping[str, Any] | None

    def extra_checkpoint_state(self, device: torch.device) -> dict[str, Any] | None:
        """The deciding rank's rule state (Bop momenta) and, with ``fp_density``, every rank's error-feedback
        residual, for rank 0's checkpoint (collective)."""
        if self.exchange is None:
            return None
        rank, world_size = process_rank_and_size()
        entry: dict[str, Any] = {"steps": self.steps, "rule": self._rule_state_on_rank_zero(world_size)}
        group = self.exchange.group  # the CPU (gloo) group: these tensors live on the CPU, NCCL refuses them
        if self.fp_sync is not None:
            entry["residuals"] = _gather_to_every_rank(self.fp_sync.residual, world_size, group)
        if self.local_bop is not None:
            entry["local_momenta"] = _gather_to_every_rank(self.local_bop.momentum, world_size, group)
        if self.error_feedback and self.layout is not None:
            residual = self.code_residual if self.code_residual is not None else torch.zeros(self.layout.numel)
            entry["code_residuals"] = _gather_to_every_rank(residual, world_size, group)
        return entry

    def _rule_state_on_rank_zero(self, world_size: int) -> dict[str, Tensor]:
        state = self.rule.state_dict() if self.rule is not None else {}
        decider = self.server if self.aggregation == "server" else 0
        if world_size == 1 or decider == 0:
            return state
        for value in state.values():  # only the server's momenta are current: hand them to rank 0
            comm.broadcast(value, decider, label=CHECKPOINT_LABEL, group=self.exchange.group)  # CPU: the gloo group
        return state

    def load_extra_checkpoint_state(self, entry: Mapping[str, Any] | None) -> None:
        """Restore the step counter, the rule state and this rank's residuals (kept until setup if it has not run).

        Residuals saved by another number of ranks are dropped (training goes on, not bit-identically).
        """
        if entry is None:
            return
        if self.exchange is None:
            self._pending_entry = entry
            return
        self.steps = int(entry.get("steps", self.steps))
        if entry.get("rule") is not None and self.rule is not None:
            self.rule.load_state_dict(entry["rule"])
        rank, world_size = process_rank_and_size()
        momenta = entry.get("local_momenta") or []
        if self.local_bop is not None and len(momenta) == world_size:
            self.local_bop.load_state_dict({"momentum": momenta[rank]})
        code_residuals = entry.get("code_residuals") or []
        if self.error_feedback and len(code_residuals) == world_size:
            self.code_residual = code_residuals[rank].detach().float().cpu().clone()
        if self.fp_sync is not None:
            residuals = entry.get("residuals") or []
            self.fp_sync.load_state_dict({"residual": residuals[rank]} if len(residuals) == world_size else {})

    def state_bytes(self) -> dict[str, Any]:
        """Bytes of the codes (int8 and 2-bit packed) and of the fp parameters, against fp32 weights + AdamW."""
        if self.module is None or self.layout is None:
            return {}
        codes = self.layout.numel
        fp = sum(p.numel() for p in self.module.parameters())
        return {
            "codes": codes,
            "code_bytes_int8": codes,
            "code_bytes_packed": math.ceil(codes * (2 if self.kind == "ternary" else 1) / 8),
            "fp_parameters": fp,
            "fp32_adamw_bytes_if_dense": 12 * (codes + fp),
        }


def _gather_to_every_rank(tensor: Tensor, world_size: int, group: Any = None) -> list[Tensor]:
    """Every rank's copy of a same-sized CPU tensor, in rank order (collective over ``group``, a CPU-capable group
    spanning the world: the default one under gloo, the exchange's gloo group under NCCL; label ``"checkpoint"``)."""
    if world_size == 1:
        return [tensor.clone()]
    gathered = torch.empty(world_size * tensor.numel(), dtype=tensor.dtype)
    comm.all_gather_into_tensor(gathered, tensor.contiguous(), label=CHECKPOINT_LABEL, group=group)
    return list(gathered.view(world_size, -1).clone().unbind(0))
