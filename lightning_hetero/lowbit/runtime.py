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
from lightning_hetero.core import (
    StrategyRuntime,
    WorldLayout,
    average_gradients,
    broadcast_module_state,
    process_rank_and_size,
)
from lightning_hetero.lowbit.convert import DEFAULT_SKIP, convert_model
from lightning_hetero.lowbit.flip import CodeLayout
from lightning_hetero.lowbit.fp_sync import SparseGradientAverage
from lightning_hetero.lowbit.layers import lowbit_layers
from lightning_hetero.lowbit.sparse import EXCHANGE_MODES, SparseFlipExchange

__all__ = ["CHECKPOINT_LABEL", "NONFINITE_POLICIES", "SparseFlipRuntime"]

CHECKPOINT_LABEL = "checkpoint"
"""Ledger label of gathering the fp residuals into rank 0's checkpoint."""
NONFINITE_POLICIES = ("raise", "skip")
"""What a step with a non-finite code gradient does: raise on every rank, or skip the flips (and warn)."""


class SparseFlipRuntime(StrategyRuntime):
    """Shared ``sparseflip`` logic: conversion, initial broadcast, the sparse flip exchange and the dense fp average.

    Args:
        kind: ``"ternary"`` ({-1, 0, +1}) or ``"binary"`` ({-1, +1}) weights.
        granularity: ``"row"`` (one fp scale per output channel) or ``"layer"``.
        flips_per_step: Codes flipped per optimizer step (``k``); None: ``ceil(flip_fraction * codes)``.
        flip_fraction: ``k`` as a fraction of all codes, when ``flips_per_step`` is None.
        tau: Fixed threshold: a rank sends the entries with ``|g| > tau``. Exclusive with ``density``.
        density: A rank sends its ``ceil(density * codes)`` largest ``|g|`` (default 0.01 when ``tau`` is None).
        encoding: Values of the sent lists: ``"fp32"``, ``"bf16"``, ``"sign"`` or ``"ternary"``.
        aggregation: ``"server"`` (lists go to one rank, which broadcasts the flips) or ``"allgather"``.
        server: Global rank of the parameter server.
        skip: Module-name patterns left in fp (default: heads, classifiers and embeddings).
        include: Layer types to convert (default: ``Linear``, ``Conv2d``, ``Conv1D``).
        drift_check_every: Every N steps, check that every rank holds bit-identical codes and weights (0: off).
        on_nonfinite: ``"raise"`` or ``"skip"`` when a rank's code gradient holds NaN/Inf.
        fp_density: None: the fp gradients are averaged densely (as DDP). A fraction in (0, 1]: each rank sends
            only that fraction of them as a sparse list, with error feedback (:mod:`~lightning_hetero.lowbit.fp_sync`).
        owner: Class name used in messages.
    """

    restore_after_setup = True  # checkpoints hold codes and scales, which exist only after conversion
    checkpoint_key = "sparseflip"

    def __init__(
        self,
        kind: str = "ternary",
        granularity: str = "row",
        flips_per_step: int | None = None,
        flip_fraction: float = 1e-3,
        tau: float | None = None,
        density: float | None = None,
        encoding: str = "bf16",
        aggregation: str = "server",
        server: int = 0,
        skip: Sequence[str] | None = None,
        include: Sequence[str] | None = None,
        drift_check_every: int = 0,
        on_nonfinite: str = "raise",
        fp_density: float | None = None,
        owner: str = "SparseFlipStrategy",
    ) -> None:
        self.owner = owner
        if kind not in ("ternary", "binary"):
            raise ValueError(f"{owner}(kind={kind!r}): use 'ternary' or 'binary'.")
        if granularity not in ("row", "layer"):
            raise ValueError(f"{owner}(granularity={granularity!r}): use 'row' or 'layer'.")
        if flips_per_step is not None and (
            isinstance(flips_per_step, bool) or not isinstance(flips_per_step, int) or flips_per_step < 1
        ):
            raise ValueError(f"{owner}(flips_per_step={flips_per_step!r}): use an int >= 1, or None for a fraction.")
        if not (isinstance(flip_fraction, (int, float)) and 0 < flip_fraction <= 1):
            raise ValueError(f"{owner}(flip_fraction={flip_fraction!r}): use a number in (0, 1].")
        if tau is not None and density is not None:
            raise ValueError(f"{owner}: give tau (a fixed threshold) or density (a fraction sent), not both.")
        if tau is not None and not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau >= 0):
            raise ValueError(f"{owner}(tau={tau!r}): use a finite number >= 0.")
        density = 0.01 if tau is None and density is None else density
        if density is not None and not (isinstance(density, (int, float)) and 0 < density <= 1):
            raise ValueError(f"{owner}(density={density!r}): use a number in (0, 1].")
        if aggregation not in EXCHANGE_MODES:
            raise ValueError(f"{owner}(aggregation={aggregation!r}): use one of {list(EXCHANGE_MODES)}.")
        if isinstance(server, bool) or not isinstance(server, int) or server < 0:
            raise ValueError(f"{owner}(server={server!r}): use a global rank (int >= 0).")
        if isinstance(drift_check_every, bool) or not isinstance(drift_check_every, int) or drift_check_every < 0:
            raise ValueError(f"{owner}(drift_check_every={drift_check_every!r}): use an int >= 0 (0 turns it off).")
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"{owner}(on_nonfinite={on_nonfinite!r}): use one of {list(NONFINITE_POLICIES)}.")
        if fp_density is not None and not (isinstance(fp_density, (int, float)) and 0 < fp_density <= 1):
            raise ValueError(
                f"{owner}(fp_density={fp_density!r}): use a number in (0, 1], or None for a dense average."
            )
        from lightning_hetero.comm import codecs

        try:
            codecs.validate_value_encoding(encoding)
        except ValueError as error:
            raise ValueError(f"{owner}(encoding={encoding!r}): {error}") from None
        self.kind, self.granularity = kind, granularity
        self.flips_per_step, self.flip_fraction = flips_per_step, float(flip_fraction)
        self.tau, self.density, self.encoding = tau, density, encoding
        self.aggregation, self.server = aggregation, server
        self.skip = tuple(DEFAULT_SKIP if skip is None else skip)
        self.include = None if include is None else list(include)
        self.drift_check_every, self.on_nonfinite = drift_check_every, on_nonfinite
        self.fp_density = fp_density
        self.fp_sync: SparseGradientAverage | None = None
        self._pending_fp_state: dict[str, Any] | None = None
        self.module: nn.Module | None = None
        self.layout: CodeLayout | None = None
        self.exchange: SparseFlipExchange | None = None
        self.k = 0
        self.steps = 0
        self._pending: tuple[Tensor, Tensor] | None = None
        self._drift_topology: Any = None
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
                module, kind=self.kind, mode="flip", granularity=self.granularity, skip=self.skip, include=self.include
            )
        module.to(device)
        layout = CodeLayout(module)
        if layout.numel == 0:
            raise ValueError(
                f"{self.owner}: the model has no layer to convert (types {self.include or 'Linear/Conv2d/Conv1D'}, "
                f"skipping {list(self.skip)}). Pass skip=[] or include=[...] to choose layers."
            )
        self.k = self.flips_per_step or math.ceil(self.flip_fraction * layout.numel)
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
                from lightning_hetero.flexdemo.topology import build_topology

                self._drift_topology = build_topology(device, 1)  # every rank its own replica
        self.exchange = SparseFlipExchange(
            layout.numel,
            self.k,
            tau=self.tau,
            density=self.density,
            encoding=self.encoding,
            mode=self.aggregation,
            server=self.server,
            label=comm.INTER,
            group=group,
        )
        if self.fp_density is not None:
            numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
            self.fp_sync = SparseGradientAverage(numel, self.fp_density, self.encoding, comm.INTER, group)
            if self._pending_fp_state is not None:
                self.load_extra_checkpoint_state(self._pending_fp_state)
        self.module, self.layout = module, layout
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
        finite = torch.tensor([float(bool(torch.isfinite(grad).all()))])
        if world_size > 1:
            comm.all_reduce(finite, "min", label=comm.INTER)
        if not bool(finite[0]):
            message = f"{self.owner}: a non-finite code gradient at step {self.steps} (on at least one rank)"
            if self.on_nonfinite == "raise":
                raise FloatingPointError(f"{message}; no flips applied. Lower the learning rate or check the data.")
            warnings.warn(f"{message}; this step's flips are skipped.", RuntimeWarning, stacklevel=2)
            self._pending, self._metrics = None, {"lowbit/skipped_nonfinite": 1.0}
            return
        indices, directions = self.exchange.step(grad, self.layout.flat_codes().cpu())
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

    # ------------------------------------------------------------------------------------------------ checkpoints
    def extra_checkpoint_state(self, device: torch.device) -> dict[str, Any] | None:
        """``fp_density``: every rank's error-feedback residual, gathered into rank 0's checkpoint (collective)."""
        if self.fp_sync is None:
            return None
        residual = self.fp_sync.residual
        _, world_size = process_rank_and_size()
        if world_size == 1:
            return {"residuals": [residual.clone()]}
        gathered = torch.empty(world_size * residual.numel(), dtype=residual.dtype)
        comm.all_gather_into_tensor(gathered, residual.contiguous(), label=CHECKPOINT_LABEL)
        return {"residuals": list(gathered.view(world_size, -1).clone().unbind(0))}

    def load_extra_checkpoint_state(self, entry: Mapping[str, Any] | None) -> None:
        """Restore this rank's residual (applied at setup when the exchange does not exist yet)."""
        if self.fp_density is None or entry is None:
            return
        if self.fp_sync is None:
            self._pending_fp_state = dict(entry)
            return
        rank, world_size = process_rank_and_size()
        residuals = entry.get("residuals", [])
        state = {"residual": residuals[rank]} if len(residuals) == world_size else {}
        self.fp_sync.load_state_dict(state)
        self._pending_fp_state = None

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
        if self._drift_topology is None or self.module is None:
            return
        from lightning_hetero.flexdemo.drift import check_replica_drift

        named = [(name, t) for name, t in self.module.state_dict().items() if isinstance(t, Tensor)]
        check_replica_drift(named, self._drift_topology, self.steps)

    def set_sync_blocked(self, blocked: bool) -> None:
        """Accumulation micro-batches add to the code gradients; the exchange runs after the final backward."""

    @torch.no_grad()
    def clip_grad_norm_(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the (already averaged, so equal on every rank) fp gradients; codes are moved by flips, not clipped."""
        params = [p for p in parameters if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

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
