"""The loop-independent core of the ``sparseflip`` strategies, shared by the Trainer and Fabric adapters.

:class:`SparseFlipRuntime` turns the model's Linear / Conv2d / HF Conv1D layers into flip-mode ternary or binary
layers (codes only, no fp master copy), gives every rank rank 0's codes and weights, and runs the seed's exchange
after each backward: every rank thresholds its code gradient, the lists meet at a parameter server (or in an
all-gather), the ``k`` strongest allowed flips come back and every rank applies the same flips after the optimizer
step, so replicas stay bit-identical (a drift guard checks it when asked). The remaining fp parameters (biases,
norms, embeddings, heads, trainable scales) are averaged densely, as DDP would (or as sparse lists with
``settings.fp_sync.kept_fraction``), and trained by the user's optimizer. Every setting lives in
:class:`~lightning_hetero.sparseflip.settings.SparseFlipSettings`, validated there.

Ledger: the flip exchange and the fp gradient average use ``"inter"``; the drift guard uses ``"drift"``; gathering
every rank's momenta and residuals into rank 0's checkpoint uses ``"checkpoint"``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hetero import comm
from lightning_hetero.core import (
    StrategyRuntime,
    WorldLayout,
    average_gradients,
    broadcast_module_state,
    process_rank_and_size,
)
from lightning_hetero.core.drift import check_replica_drift
from lightning_hetero.sparseflip.convert import DEFAULT_SKIP, convert_model
from lightning_hetero.sparseflip.flip import CodeLayout, move_allowed
from lightning_hetero.sparseflip.fp_sync import SparseGradientAverage
from lightning_hetero.sparseflip.layers import lowbit_layers
from lightning_hetero.sparseflip.rules import BopRule, LocalBop, ThresholdRule, TopKRule
from lightning_hetero.sparseflip.settings import SparseFlipSettings
from lightning_hetero.sparseflip.sparse import SparseFlipExchange

__all__ = ["CHECKPOINT_LABEL", "SparseFlipRuntime"]

CHECKPOINT_LABEL = "checkpoint"
"""Ledger label of gathering the momenta and residuals into rank 0's checkpoint."""


class SparseFlipRuntime(StrategyRuntime):
    """Shared ``sparseflip`` logic: conversion, initial broadcast, the sparse flip exchange and the fp average.

    Args:
        settings: The strategy's settings (see :class:`~lightning_hetero.sparseflip.settings.SparseFlipSettings`).
        owner: Class name used in messages.
    """

    restore_after_setup = True  # checkpoints hold codes and scales, which exist only after conversion
    checkpoint_key = "sparseflip"

    settings: SparseFlipSettings

    def __init__(self, settings: SparseFlipSettings, owner: str = "SparseFlipStrategy") -> None:
        self._attach_settings(settings, SparseFlipSettings, owner)
        self._skip = tuple(DEFAULT_SKIP if settings.skip is None else settings.skip)
        # "local_bop" keeps a momentum per code on every rank: that is its memory, so no residual on top of it.
        self.error_feedback = settings.exchange.error_feedback and settings.flip.rule != "local_bop"
        self.rule: TopKRule | BopRule | ThresholdRule | None = None
        self.total_steps: int | None = None
        """Optimizer steps of the whole run, when known (drives Bop's decay); the Trainer adapter sets it."""
        self.local_bop: LocalBop | None = None
        self.code_residual: Tensor | None = None
        self.fp_sync: SparseGradientAverage | None = None
        self._pending_entry: Mapping[str, Any] | None = None
        self.module: nn.Module | None = None
        self.layout: CodeLayout | None = None
        self.exchange: SparseFlipExchange | None = None
        self.k = 0
        self.steps = 0
        self._pending: tuple[Tensor, Tensor] | None = None
        self._drift_replicas = 0  # ranks that each hold a copy, set at setup when the drift guard is on
        self._metrics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ launch
    def resolve_launch(self, world: WorldLayout) -> None:
        """The parameter server must be one of the launched ranks."""
        exchange = self.settings.exchange
        if exchange.aggregation == "server" and exchange.server >= world.world_size:
            raise ValueError(
                f"{self.owner}: SparseFlipSettings.exchange.server={exchange.server}, but the run has "
                f"{world.world_size} rank(s); pick a server in 0..{world.world_size - 1}."
            )

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self, module: nn.Module, device: torch.device) -> nn.Module:
        """Convert ``module`` in place (once), copy rank 0's state everywhere and build the exchange (collective).

        Raises:
            ValueError: no layer to convert, or ``flip.max_per_step`` larger than the number of codes.
        """
        settings = self.settings
        if self.module is not None and self.module is not module:
            raise RuntimeError(f"{self.owner} trains one model; setup was already called with another.")
        if not lowbit_layers(module, mode="flip"):
            convert_model(
                module,
                kind=settings.kind,
                mode="flip",
                granularity=settings.granularity,
                skip=self._skip,
                include=None if settings.include is None else list(settings.include),
                trainable_scale=settings.trainable_scale,
                zero_fraction=settings.zero_fraction if settings.kind == "ternary" else None,
            )
        module.to(device)
        layout = CodeLayout(module)
        if layout.numel == 0:
            raise ValueError(
                f"{self.owner}: the model has no layer to convert (types "
                f"{list(settings.include or ()) or 'Linear/Conv2d/Conv1D'}, skipping {list(self._skip)}). Set "
                "SparseFlipSettings.skip=[] or include=[...] to choose layers."
            )
        flip = settings.flip
        fraction = flip.max_fraction if flip.max_fraction is not None else (1e-3 if flip.rule == "topk" else None)
        cap = flip.max_per_step or (math.ceil(fraction * layout.numel) if fraction is not None else None)
        self.k = cap or layout.numel
        if self.k > layout.numel:
            raise ValueError(
                f"{self.owner}: SparseFlipSettings.flip.max_per_step={self.k}, but the model has only "
                f"{layout.numel} codes; use at most that."
            )
        _, world_size = process_rank_and_size()
        group = None
        if world_size > 1:
            broadcast_module_state(module, 0, label=comm.INTER)  # codes, scales and fp weights of rank 0
            # The lists are small uint8 messages: under NCCL they travel over a gloo group on the CPU.
            group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
            if settings.drift_check_every:
                self._drift_replicas = world_size  # every rank its own replica
        exchange = settings.exchange
        threshold, kept = exchange.send_threshold, exchange.kept_fraction
        if flip.rule == "local_bop":
            self.local_bop = LocalBop(layout.offsets, flip.bop_gamma)
            self.rule = ThresholdRule(flip.bop_threshold, cap)
            if threshold is None and kept is None:
                threshold = exchange.send_threshold_ratio * flip.bop_threshold
        elif flip.rule == "bop":
            self.rule = BopRule(layout.offsets, flip.bop_gamma, flip.bop_threshold, reset=0.0, cap=cap)
        else:
            self.rule = TopKRule(self.k)
        if threshold is None and kept is None:
            kept = 0.01
        self.exchange = SparseFlipExchange(
            layout.numel,
            self.k,
            tau=threshold,
            density=kept,
            encoding=exchange.encoding,
            mode=exchange.aggregation,
            server=exchange.server,
            label=comm.INTER,
            group=group,
            rule=self.rule,
            on_bad_payload=settings.on_bad_payload,
        )
        if settings.fp_sync.kept_fraction is not None:
            numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
            self.fp_sync = SparseGradientAverage(
                numel, settings.fp_sync.kept_fraction, exchange.encoding, comm.INTER, group, settings.on_bad_payload
            )
        self.module, self.layout = module, layout
        if self._pending_entry is not None:  # a checkpoint loaded before setup
            entry, self._pending_entry = self._pending_entry, None
            self.load_extra_checkpoint_state(entry)
        return module

    # ------------------------------------------------------------------------------------------------ training
    def sync_gradients(self) -> None:
        """After the final backward of a step: average the fp gradients, exchange the code gradients (collective)."""
        if self.module is None or self.layout is None or self.exchange is None:
            raise RuntimeError(f"{self.owner}: sync_gradients() before setup; set up the module first.")
        _, world_size = process_rank_and_size()
        sent_before = comm.get_ledger().totals(comm.INTER).sent
        self._sync_fp_gradients(world_size)
        grad = self.layout.flat_grad().cpu()
        if self.code_residual is not None:
            grad = grad + self.code_residual
        finite = torch.tensor([float(bool(torch.isfinite(grad).all()))])
        if world_size > 1:  # a CPU flag: over the exchange's gloo group (an NCCL world refuses CPU tensors)
            comm.all_reduce(finite, "min", label=comm.INTER, group=self.exchange.group)
        if not bool(finite[0]):
            message = f"{self.owner}: a non-finite code gradient at step {self.steps} (on at least one rank)"
            if self.settings.on_nonfinite == "raise":
                raise FloatingPointError(f"{message}; no flips applied. Lower the learning rate or check the data.")
            warnings.warn(f"{message}; this step's flips are skipped.", RuntimeWarning, stacklevel=2)
            self._pending, self._metrics = None, {"lowbit/skipped_nonfinite": 1.0}
            return
        decaying = self.local_bop if self.local_bop is not None else self.rule
        if isinstance(decaying, (BopRule, LocalBop)) and self.total_steps:
            decaying.set_progress(self.steps / self.total_steps, self.settings.flip.bop_decay_to)
        codes = self.layout.flat_codes().cpu()
        if self.local_bop is not None:
            momentum = self.local_bop.update(grad)  # a rank sends its momenta, not its gradient,
            allowed = move_allowed(codes, (-torch.sign(momentum)).to(torch.int8))
            grad = torch.where(allowed, momentum, torch.zeros_like(momentum))  # and none of saturated codes
        indices, directions = self.exchange.step(grad, codes)
        if self.local_bop is not None:
            self.local_bop.reset(indices)
        if self.error_feedback:
            sent_indices, sent_values = self.exchange.last_sent
            grad.index_add_(0, sent_indices, -sent_values)
            self.code_residual = grad
        self._pending = (indices, directions)
        self._metrics = {
            "lowbit/selected": float(self.exchange.last_selected),
            "comm/inter/bytes_sent_step": float(comm.get_ledger().totals(comm.INTER).sent - sent_before),
            "comm/flip_bytes_sent": float(self.exchange.last_bytes[0]),
            "comm/flip_bytes_received": float(self.exchange.last_bytes[1]),
        }

    def _sync_fp_gradients(self, world_size: int) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad] if self.module is not None else []
        if self.fp_sync is None:
            if world_size > 1 and params:
                average_gradients(params, None, comm.INTER)
            return
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        flat = torch.cat([p.grad.reshape(-1).float() for p in params])
        averaged = self.fp_sync.average(flat)
        offset = 0
        for param in params:
            count = param.numel()
            param.grad.copy_(averaged[offset : offset + count].view_as(param.grad))
            offset += count

    def after_optimizer_step(self) -> dict[str, float]:
        """Apply the step's flips, clear the code gradients, run the drift guard when due; returns the metrics."""
        if self.layout is None:
            raise RuntimeError(f"{self.owner}: the optimizer stepped before setup.")
        moved = 0
        if self._pending is not None:
            moved = self.layout.apply(*self._pending)
            self._pending = None
        self.layout.zero_grad()
        self.steps += 1
        every = self.settings.drift_check_every
        if every and self.steps % every == 0:
            self.check_drift()
        metrics, self._metrics = {**self._metrics, "lowbit/flips": float(moved)}, {}
        return metrics

    # ------------------------------------------------------------------------------------------------ checkpoints
    def extra_checkpoint_state(self, device: torch.device) -> dict[str, Any] | None:
        """The deciding rank's rule state (Bop momenta) and, with ``fp_sync.kept_fraction``, every rank's error-feedback
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
        exchange = self.settings.exchange
        decider = exchange.server if exchange.aggregation == "server" else 0
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
            "code_bytes_packed": math.ceil(codes * (2 if self.settings.kind == "ternary" else 1) / 8),
            "fp_parameters": fp,
            "fp32_adamw_bytes_if_dense": 12 * (codes + fp),
        }

    def check_drift(self) -> None:
        """Raise on every rank if any rank's codes or weights differ from rank 0's (collective)."""
        if not self._drift_replicas or self.module is None:
            return
        named = [(name, t) for name, t in self.module.state_dict().items() if isinstance(t, Tensor)]
        check_replica_drift(named, self.steps, owner=self.owner, num_replicas=self._drift_replicas)

    def set_sync_blocked(self, blocked: bool) -> None:
        """Accumulation micro-batches add to the code gradients; the exchange runs after the final backward."""

    @torch.no_grad()
    def clip_grad_norm_(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the (already averaged, so equal on every rank) fp gradients; codes are moved by flips, not clipped."""
        params = [p for p in parameters if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)


def _gather_to_every_rank(tensor: Tensor, world_size: int, group: Any = None) -> list[Tensor]:
    """Every rank's copy of a same-sized CPU tensor, in rank order (collective over ``group``, a CPU-capable group
    spanning the world: the default one under gloo, the exchange's gloo group under NCCL; label ``"checkpoint"``)."""
    if world_size == 1:
        return [tensor.clone()]
    gathered = torch.empty(world_size * tensor.numel(), dtype=tensor.dtype)
    comm.all_gather_into_tensor(gathered, tensor.contiguous(), label=CHECKPOINT_LABEL, group=group)
    return list(gathered.view(world_size, -1).clone().unbind(0))
