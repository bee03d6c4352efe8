"""The loop-independent core of the ``sparseflip`` strategies, shared by the Trainer and Fabric adapters.

:class:`SparseFlipRuntime` turns the model's Linear / Conv2d / HF Conv1D layers into flip-mode ternary or binary
layers (codes only, no fp master copy), gives every rank rank 0's codes and weights, and runs the seed's exchange
after each backward: every rank thresholds its code gradient, the lists meet at a parameter server (or in an
all-gather), the ``k`` strongest allowed flips come back and every rank applies the same flips after the optimizer
step, so replicas stay bit-identical (a drift guard checks it when asked). The remaining fp parameters (biases,
norms, embeddings, heads, trainable scales) are averaged densely, as DDP would, and trained by the user's optimizer.

Ledger: the flip exchange and the fp gradient average use ``"inter"``; the drift guard uses ``"drift"``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hetero import comm
from lightning_hetero.comm.validation import validate_on_bad_payload
from lightning_hetero.core import (
    StrategyRuntime,
    WorldLayout,
    average_gradients,
    broadcast_module_state,
    process_rank_and_size,
)
from lightning_hetero.core.drift import check_replica_drift
from lightning_hetero.lowbit.arguments import check_arguments
from lightning_hetero.lowbit.convert import DEFAULT_SKIP, convert_model
from lightning_hetero.lowbit.flip import CodeLayout, move_allowed
from lightning_hetero.lowbit.fp_sync import SparseGradientAverage
from lightning_hetero.lowbit.layers import lowbit_layers
from lightning_hetero.lowbit.rules import BopRule, LocalBop, ThresholdRule, TopKRule
from lightning_hetero.lowbit.runtime_state import SparseFlipStateMixin
from lightning_hetero.lowbit.sparse import SparseFlipExchange

__all__ = ["SparseFlipRuntime"]


class SparseFlipRuntime(SparseFlipStateMixin, StrategyRuntime):
    """Shared ``sparseflip`` logic: conversion, initial broadcast, the sparse flip exchange and the dense fp average.

    Args:
        kind: ``"ternary"`` ({-1, 0, +1}) or ``"binary"`` ({-1, +1}) weights.
        granularity: ``"row"`` (one fp scale per output channel) or ``"layer"``.
        flip_rule: How gradients become flips (:mod:`lightning_hetero.lowbit.rules`): ``"local_bop"`` (every rank
            keeps Bop's momentum of its own gradient and sends the momenta past ``send_fraction * bop_threshold``;
            codes whose mean momentum passes ``bop_threshold`` move), ``"bop"`` (Bop on the deciding rank over the
            aggregated sparse gradients) or ``"topk"`` (the seed's top-``k`` of the summed lists).
        send_fraction: ``"local_bop"``: a rank sends the momenta above this fraction of ``bop_threshold`` (when
            neither ``tau`` nor ``density`` is given).
        flips_per_step: At most this many flips per step (``k``); None: ``ceil(flip_fraction * codes)``.
        flip_fraction: ``k`` as a fraction of all codes when ``flips_per_step`` is None. None: 0.001 for ``"topk"``,
            no cap for ``"bop"``.
        bop_gamma: Bop's momentum rate (cosine-decayed to ``bop_decay_to`` x over the run when the length is known).
        bop_threshold: Bop's threshold, a fraction of each layer's rms gradient.
        bop_decay_to: Final fraction of ``bop_gamma``.
        trainable_scale: The per-row (or per-layer) fp scales are parameters, trained by your optimizer.
        zero_fraction: Ternary initialization: this fraction of each row's smallest ``|W|`` starts at 0 (None: round).
        tau: Fixed threshold: a rank sends the entries with ``|g| > tau``. Exclusive with ``density``.
        density: A rank sends its ``ceil(density * codes)`` largest ``|g|`` (default 0.01 when ``tau`` is None, except
            with ``"local_bop"``, where the default is ``tau = send_fraction * bop_threshold`` on the momenta).
        encoding: Values of the sent lists: ``"sign"`` (1 bit and one fp32 scale per message), ``"ternary"``,
            ``"bf16"`` or ``"fp32"``.
        aggregation: ``"server"`` (lists go to one rank, which broadcasts the flips) or ``"allgather"``.
        server: Global rank of the parameter server.
        skip: Module-name patterns left in fp (default: heads, classifiers and embeddings).
        include: Layer types to convert (default: ``Linear``, ``Conv2d``, ``Conv1D``).
        drift_check_every: Every N steps, check that every rank holds bit-identical codes and weights (0: off).
        on_nonfinite: ``"raise"`` or ``"skip"`` when a rank's code gradient holds NaN/Inf.
        error_feedback: Each rank keeps the code gradient it did not send (or sent rounded) and adds it to the next
            step's, so every code's gradient is eventually heard (4 bytes per code per rank; saved in checkpoints).
        fp_density: None: the fp gradients are averaged densely (as DDP). A fraction in (0, 1]: each rank sends
            only that fraction of them as a sparse list, with error feedback (:mod:`~lightning_hetero.lowbit.fp_sync`).
        on_bad_payload: ``"raise"`` (default): a corrupt peer list (index out of range, NaN/Inf, wrong length)
            stops training with a :class:`~lightning_hetero.comm.validation.PeerPayloadError` on every rank;
            ``"drop"``: it is left out of the step (logged).
        owner: Class name used in messages.
    """

    restore_after_setup = True  # checkpoints hold codes and scales, which exist only after conversion
    checkpoint_key = "sparseflip"

    def __init__(
        self,
        kind: str = "ternary",
        granularity: str = "row",
        flip_rule: str = "local_bop",
        send_fraction: float = 1.0,
        flips_per_step: int | None = None,
        flip_fraction: float | None = None,
        bop_gamma: float = 0.03,
        bop_threshold: float = 0.2,
        bop_decay_to: float = 0.1,
        trainable_scale: bool = True,
        zero_fraction: float | None = 0.5,
        tau: float | None = None,
        density: float | None = None,
        encoding: str = "sign",
        aggregation: str = "server",
        server: int = 0,
        skip: Sequence[str] | None = None,
        include: Sequence[str] | None = None,
        drift_check_every: int = 0,
        on_nonfinite: str = "raise",
        error_feedback: bool = True,
        fp_density: float | None = None,
        on_bad_payload: str = "raise",
        owner: str = "SparseFlipStrategy",
    ) -> None:
        self.owner = owner
        self.on_bad_payload = validate_on_bad_payload(owner, on_bad_payload)
        check_arguments(
            owner,
            kind=kind,
            granularity=granularity,
            flip_rule=flip_rule,
            flips_per_step=flips_per_step,
            flip_fraction=flip_fraction,
            bop_gamma=bop_gamma,
            bop_threshold=bop_threshold,
            bop_decay_to=bop_decay_to,
            zero_fraction=zero_fraction,
            tau=tau,
            density=density,
            encoding=encoding,
            aggregation=aggregation,
            server=server,
            drift_check_every=drift_check_every,
            on_nonfinite=on_nonfinite,
            fp_density=fp_density,
        )
        self.kind, self.granularity = kind, granularity
        self.flip_rule, self.flips_per_step, self.flip_fraction = flip_rule, flips_per_step, flip_fraction
        self.bop_gamma, self.bop_threshold, self.bop_decay_to = bop_gamma, bop_threshold, bop_decay_to
        self.trainable_scale, self.zero_fraction = bool(trainable_scale), zero_fraction
        self.rule: TopKRule | BopRule | ThresholdRule | None = None
        self.total_steps: int | None = None
        """Optimizer steps of the whole run, when known (drives Bop's decay); the Trainer adapter sets it."""
        self.tau, self.density, self.encoding = tau, density, encoding
        self.aggregation, self.server = aggregation, server
        self.skip = tuple(DEFAULT_SKIP if skip is None else skip)
        self.include = None if include is None else list(include)
        self.drift_check_every, self.on_nonfinite = drift_check_every, on_nonfinite
        self.fp_density = fp_density
        self.error_feedback = bool(error_feedback) and flip_rule != "local_bop"  # there the momentum is the memory
        self.send_fraction = send_fraction
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
        if self.aggregation == "server" and self.server >= world.world_size:
            raise ValueError(
                f"{self.owner}(server={self.server}): the run has {world.world_size} rank(s); pick a server in "
                f"0..{world.world_size - 1}."
            )

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self, module: nn.Module, device: torch.device) -> nn.Module:
        """Convert ``module`` in place (once), copy rank 0's state everywhere and build the exchange (collective).

        Raises:
            ValueError: no layer to convert, or ``flips_per_step`` larger than the number of codes.
        """
        if self.module is not None and self.module is not module:
            raise RuntimeError(f"{self.owner} trains one model; setup was already called with another.")
        if not lowbit_layers(module, mode="flip"):
            convert_model(
                module,
                kind=self.kind,
                mode="flip",
                granularity=self.granularity,
                skip=self.skip,
                include=self.include,
                trainable_scale=self.trainable_scale,
                zero_fraction=self.zero_fraction if self.kind == "ternary" else None,
            )
        module.to(device)
        layout = CodeLayout(module)
        if layout.numel == 0:
            raise ValueError(
                f"{self.owner}: the model has no layer to convert (types {self.include or 'Linear/Conv2d/Conv1D'}, "
                f"skipping {list(self.skip)}). Pass skip=[] or include=[...] to choose layers."
            )
        fraction = (
            self.flip_fraction if self.flip_fraction is not None else (1e-3 if self.flip_rule == "topk" else None)
        )
        cap = self.flips_per_step or (math.ceil(fraction * layout.numel) if fraction is not None else None)
        self.k = cap or layout.numel
        if self.k > layout.numel:
            raise ValueError(
                f"{self.owner}(flips_per_step={self.k}): the model has only {layout.numel} codes; use at most that."
            )
        _, world_size = process_rank_and_size()
        group = None
        if world_size > 1:
            broadcast_module_state(module, 0, label=comm.INTER)  # codes, scales and fp weights of rank 0
            # The lists are small uint8 messages: under NCCL they travel over a gloo group on the CPU.
            group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
            if self.drift_check_every:
                self._drift_replicas = world_size  # every rank its own replica
        tau, density = self.tau, self.density
        if self.flip_rule == "local_bop":
            self.local_bop = LocalBop(layout.offsets, self.bop_gamma)
            self.rule = ThresholdRule(self.bop_threshold, cap)
            if tau is None and density is None:
                tau = self.send_fraction * self.bop_threshold
        elif self.flip_rule == "bop":
            self.rule = BopRule(layout.offsets, self.bop_gamma, self.bop_threshold, reset=0.0, cap=cap)
        else:
            self.rule = TopKRule(self.k)
        if tau is None and density is None:
            density = 0.01
        self.exchange = SparseFlipExchange(
            layout.numel,
            self.k,
            tau=tau,
            density=density,
            encoding=self.encoding,
            mode=self.aggregation,
            server=self.server,
            label=comm.INTER,
            group=group,
            rule=self.rule,
            on_bad_payload=self.on_bad_payload,
        )
        if self.fp_density is not None:
            numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
            self.fp_sync = SparseGradientAverage(
                numel, self.fp_density, self.encoding, comm.INTER, group, self.on_bad_payload
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
            if self.on_nonfinite == "raise":
                raise FloatingPointError(f"{message}; no flips applied. Lower the learning rate or check the data.")
            warnings.warn(f"{message}; this step's flips are skipped.", RuntimeWarning, stacklevel=2)
            self._pending, self._metrics = None, {"lowbit/skipped_nonfinite": 1.0}
            return
        decaying = self.local_bop if self.local_bop is not None else self.rule
        if isinstance(decaying, (BopRule, LocalBop)) and self.total_steps:
            decaying.set_progress(self.steps / self.total_steps, self.bop_decay_to)
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
            "comm/inter_bytes_sent": float(comm.get_ledger().totals(comm.INTER).sent - sent_before),
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
        if self.drift_check_every and self.steps % self.drift_check_every == 0:
            self.check_drift()
        metrics, self._metrics = {**self._metrics, "lowbit/flips": float(moved)}, {}
        return metrics

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
