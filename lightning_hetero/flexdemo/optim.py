"""Optimizers whose update is exchanged between replicas by a :class:`~.replicators.Replicator`.

:class:`ReplicatingOptimizer` owns the protocol shared by every optimizer here:

1. ``bind(group)`` names the replicate (inter-node) process group; unbound means a single replica (nothing is sent,
   the update is computed as with ``n = 1``; a warning is issued once if ``torch.distributed`` runs with more than
   one rank, because each rank then trains on its own).
2. ``launch(params)`` (optional, for overlap with backward): for parameters whose gradients are final, update the
   local state, encode, and start the async inter-node collective for that bucket. Every replica must launch the
   same parameters in the same order (collectives are matched by order).
3. ``step()`` launches everything not launched yet as one bucket, waits for every bucket in launch order, decodes
   (identically on every replica), applies the update, then lets the replicator finish the step (DiLoCo's outer
   sync). Results do not depend on how parameters were bucketed.

Parameters may be FSDP2 ``DTensor`` shards: the optimizer works on ``to_local()`` views; empty local shards cost no
bytes and are updated trivially. All optimizer state is float32 (also under bf16 parameters) and lives in
``optimizer.state[p]``; the replicator's state (step counter, which drives every pseudo-random selection, and DiLoCo's
anchors/outer momentum) is saved under the extra top-level key ``"replicator"`` of :meth:`state_dict`.

Semantics (``g`` the local gradient after the strategy's clipping, ``eta`` the lr, ``lambda`` the weight decay,
``R`` the replicator's combination over replicas, ``EF`` error feedback: what was sent leaves the local buffer):

* :class:`DeMoSGD` (``momentum`` = ``beta``)
    - compressing replicators (demo, random, striding, topk): ``delta <- beta * delta + eta * g`` (DeMo's lr inside
      the momentum, kept for parity: each gradient is weighted by the lr active when it arrived, and lr enters twice),
      ``u = R(delta)`` with ``delta <- delta - sent``; ``theta <- theta (1 - eta lambda) - eta * sign(u)``
      (``sign=False``: ``- eta * u``);
    - full / diloco (``exchanges_gradient``): ``gbar = R(g)`` (replica mean; DiLoCo: the local g),
      ``delta <- beta * delta + eta * gbar``, ``theta <- theta (1 - eta lambda) - eta * sign(delta)``: Signum on the
      mean gradient, the full-sync baseline (averaging is linear, so this equals averaging local momenta, but keeps
      ``delta`` identical on every replica).
* :class:`DecoupledAdamW` (Adam moments are local and never sent)
    - compressing replicators: local Adam on g, ``d = m_hat / (sqrt(v_hat) + eps)``, ``e <- e + d``,
      ``u = R(e)`` with ``e <- e - sent`` (error feedback on the direction), ``theta <- theta (1 - eta lambda) - eta u``
      (``sign=True``: ``sign(u)``);
    - full: ``gbar = R(g)`` first, then exactly ``torch.optim.AdamW`` on ``gbar`` (same formula and order:
      decay, ``m.lerp_``, ``v``, bias corrections, ``denom = sqrt(v) / sqrt(bc2) + eps``): with fp32 values
      Full + DecoupledAdamW on ``n`` replicas equals torch AdamW on the replica-mean gradient, and the moments stay
      identical on every replica;
    - diloco: local AdamW on the local gradient, plus the replicator's outer step every ``H`` steps.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_hetero.flexdemo.replicators import Bucket, Replicator, build_replicator

try:  # DTensor moved to a public module in torch 2.4; keep plain tensors working without it
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["DecoupledAdamW", "DeMoSGD", "ReplicatingOptimizer", "local_tensor"]

_REPLICATOR_KEY = "replicator"


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``tensor`` as a plain tensor sharing its storage (``tensor`` itself if not a DTensor)."""
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


@dataclass
class _Entry:
    key: int
    param: torch.Tensor
    group: dict[str, Any]


class ReplicatingOptimizer(torch.optim.Optimizer):
    """Base class: local state update, replicated exchange, apply. Subclasses define ``_source`` and ``_apply``.

    Args:
        params: Parameters or parameter groups (plain tensors or FSDP2 DTensors).
        defaults: Per-group hyperparameters.
        replicator: A :class:`Replicator`, a name for :func:`build_replicator`, or None for the class default.
        compression: Passed to :func:`build_replicator` when ``replicator`` is a name or None.
        replicator_options: Passed to :func:`build_replicator` likewise.
    """

    default_replicator: ClassVar[str] = "demo"

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        replicator: Replicator | str | None,
        compression: float,
        replicator_options: dict[str, Any],
    ) -> None:
        super().__init__(params, defaults)
        self.replicator = self._resolve_replicator(replicator, compression, replicator_options)
        self.replicator.attach(self)
        self._bound = False
        self._step_open = False
        self._buckets: list[tuple[list[_Entry], Bucket]] = []
        self._launched: set[int] = set()
        self._launched_early = 0
        self._warned_unbound = False
        self._last_stats: dict[str, Any] = {}

    # ---------------------------------------------------------------------------------------------- set up
    def _resolve_replicator(
        self, replicator: Replicator | str | None, compression: float, options: dict[str, Any]
    ) -> Replicator:
        if isinstance(replicator, Replicator):
            if options:
                raise ValueError(
                    f"replicator options {sorted(options)} were given with a ready-built {type(replicator).__name__};"
                    " pass them to its constructor (or pass the replicator by name)."
                )
            return replicator
        if replicator is None or isinstance(replicator, str):
            return build_replicator(replicator or self.default_replicator, compression, **options)
        raise TypeError(f"replicator must be a Replicator, a name or None, got {type(replicator).__name__}.")

    def bind(self, group: Any | None, replicator: Replicator | None = None) -> None:
        """Use ``group`` as the replicate group (None: a single replica); optionally swap in ``replicator`` first.

        Raises:
            RuntimeError: A replicator swap after the first step (its state would not match the optimizer's).
        """
        if replicator is not None and replicator is not self.replicator:
            if self.replicator.step or any(self.state.values()):
                raise RuntimeError("bind(replicator=...) must happen before the first optimizer step.")
            replicator.attach(self)
            self.replicator = replicator
        self.replicator.setup(group)
        self._bound = True

    @property
    def num_replicas(self) -> int:
        """Replicas the update is combined over (1 when unbound)."""
        return self.replicator.num_replicas

    def _entries(self) -> list[_Entry]:
        entries, key = [], 0
        for group in self.param_groups:
            for param in group["params"]:
                entries.append(_Entry(key, param, group))
                key += 1
        return entries

    def _open_step(self) -> None:
        if self._step_open:
            return
        if (
            not self._bound
            and not self._warned_unbound
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            warnings.warn(
                f"{type(self).__name__}.step() before bind(): running as a single replica (no inter-node exchange)."
                " Call optimizer.bind(replicate_group) (the FlexDeMo strategy does) or bind(None) to silence this.",
                stacklevel=3,
            )
            self._warned_unbound = True
        self.replicator.start_step([(e.key, local_tensor(e.param)) for e in self._entries()])
        self._step_open = True

    # -------------------------------------------------------------------------------------------- protocol
    def launch(self, params: Iterable[torch.Tensor]) -> None:
        """Encode ``params`` (gradients final) and start their inter-node collective now, as one bucket.

        Raises:
            ValueError: A parameter this optimizer does not hold.
            RuntimeError: A parameter launched twice in one step.
        """
        wanted = list(params)
        if not wanted:
            return
        by_id = {id(e.param): e for e in self._entries()}
        entries = []
        for param in wanted:
            entry = by_id.get(id(param))
            if entry is None:
                raise ValueError("launch() got a parameter that is not in this optimizer's param_groups.")
            if entry.key in self._launched:
                raise RuntimeError(f"Parameter #{entry.key} was already launched in this step.")
            entries.append(entry)
        with torch.no_grad():
            self._open_step()
            self._launch(entries, early=True)

    def _launch(self, entries: list[_Entry], *, early: bool) -> None:
        pieces = []
        for entry in entries:
            state = self.state[entry.param]
            local = local_tensor(entry.param)
            grad = entry.param.grad
            if grad is None:  # every replica must join each collective: a missing gradient counts as zero
                grad_local = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
            else:
                grad_local = local_tensor(grad).float()
            pieces.append(self.replicator.encode(entry.key, self._source(state, grad_local, entry.group)))
            self._launched.add(entry.key)
        if early:
            self._launched_early += len(entries)
        self._buckets.append((entries, self.replicator.launch(pieces, early=early)))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Launch what was not launched, wait, decode and apply; return the closure's loss if one was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._open_step()
        entries = self._entries()
        pending = [e for e in entries if e.key not in self._launched]
        if pending:
            self._launch(pending, early=False)
        for bucket_entries, bucket in self._buckets:
            for entry, combined in zip(bucket_entries, self.replicator.finish(bucket), strict=True):
                self._apply(self.state[entry.param], local_tensor(entry.param), combined, entry.group)
        self.replicator.end_step([(e.key, local_tensor(e.param)) for e in entries])
        self._last_stats = {
            **self.replicator.stats,
            "launched_early": self._launched_early,
            "step": self.replicator.step,
        }
        self._buckets, self._launched, self._launched_early, self._step_open = [], set(), 0, False
        return loss

    def comm_stats(self) -> dict[str, Any]:
        """Of the last completed step: ``launched_early`` (parameters launched before ``step()``), ``buckets``,
        ``wait_seconds`` (blocked in wait), ``comm_seconds`` (launch to completion, summed over buckets; an upper
        bound: completion is observed when waited for), ``encode_seconds``, ``decode_seconds``, ``payload_bytes``
        (this rank's inter-node payload) and ``step`` (steps completed)."""
        return dict(self._last_stats)

    # ----------------------------------------------------------------------------------------- subclass API
    def _source(self, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The float32 tensor handed to the replicator (mutated in place by error feedback)."""
        raise NotImplementedError

    def _apply(self, state: dict[str, Any], param: torch.Tensor, combined: torch.Tensor, group: dict[str, Any]) -> None:
        """Update the local parameter shard ``param`` in place from the combined tensor."""
        raise NotImplementedError

    @staticmethod
    def _buffer(state: dict[str, Any], name: str, like: torch.Tensor) -> torch.Tensor:
        if name not in state:
            state[name] = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        return state[name]

    @staticmethod
    def _descend(param: torch.Tensor, direction: torch.Tensor, group: dict[str, Any]) -> None:
        """Decoupled weight decay, then ``param -= lr * (sign(direction) if sign else direction)``."""
        lr, weight_decay = group["lr"], group["weight_decay"]
        if weight_decay:
            param.mul_(1 - lr * weight_decay)
        update = torch.sign(direction) if group["sign"] else direction
        param.add_(update.to(param.dtype), alpha=-lr)

    # ------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus the replicator's state under ``"replicator"``."""
        state_dict = super().state_dict()
        state_dict[_REPLICATOR_KEY] = self.replicator.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly: state tensors keep their saved dtype (float32 under bf16 params).

        Raises:
            ValueError: The parameter groups do not match this optimizer's.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(group["params"])
            for saved, group in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError("The checkpoint's parameter groups do not match this optimizer's (count or sizes).")
        by_index = {
            index: param
            for saved, group in zip(saved_groups, self.param_groups, strict=True)
            for index, param in zip(saved["params"], group["params"], strict=True)
        }
        self.state.clear()
        for index, saved_state in state_dict["state"].items():
            param = by_index[index]
            device = local_tensor(param).device
            restored = {}
            for name, value in saved_state.items():
                if isinstance(value, torch.Tensor):
                    restored[name] = value.detach().clone() if name == "step" else value.detach().to(device).clone()
                else:
                    restored[name] = copy.deepcopy(value)
            self.state[param] = restored
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})
        if _REPLICATOR_KEY in state_dict:
            self.replicator.load_state_dict(state_dict[_REPLICATOR_KEY])


def _check(name: str, value: float, low: float, high: float | None = None, *, open_high: bool = True) -> None:
    ok = value >= low and (high is None or (value < high if open_high else value <= high))
    if not ok:
        bound = "" if high is None else f" and {'<' if open_high else '<='} {high}"
        raise ValueError(f"{name} must be >= {low}{bound}, got {value!r}.")


class DeMoSGD(ReplicatingOptimizer):
    """Decoupled-momentum SGD (DeMo / FlexDeMo): local momentum, replicated fast components, sign update.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (enters the momentum and the step, as in DeMo).
        momentum: Momentum decay ``beta`` (DeMo's ``compression_decay``), in ``[0, 1)``.
        weight_decay: Decoupled weight decay ``lambda``: ``theta <- theta * (1 - lr * lambda)`` before the step.
        sign: Apply ``sign`` to the combined update (DeMo: always).
        replicator: Replicator or name; default ``"demo"``.
        compression: Fraction kept, for a replicator built by name.
        **replicator_options: Options for a replicator built by name (``values``, ``chunk``, ``index_bits``, ...).
    """

    default_replicator = "demo"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.999,
        weight_decay: float = 0.0,
        sign: bool = True,
        replicator: Replicator | str | None = None,
        compression: float = 1 / 32,
        **replicator_options: Any,
    ) -> None:
        _check("lr", lr, 0.0)
        _check("momentum", momentum, 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "sign": bool(sign)}
        super().__init__(
            params, defaults, replicator=replicator, compression=compression, replicator_options=replicator_options
        )

    def _source(self, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        if self.replicator.exchanges_gradient:
            return grad
        delta = self._buffer(state, "delta", grad)
        return delta.mul_(group["momentum"]).add_(grad, alpha=group["lr"])

    def _apply(self, state: dict[str, Any], param: torch.Tensor, combined: torch.Tensor, group: dict[str, Any]) -> None:
        if self.replicator.exchanges_gradient:
            delta = self._buffer(state, "delta", combined)
            combined = delta.mul_(group["momentum"]).add_(combined, alpha=group["lr"])
        self._descend(param, combined, group)


class DecoupledAdamW(ReplicatingOptimizer):
    """AdamW with local, never-sent moments; the replicator exchanges the gradient (full) or the update direction.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        betas: Adam's ``(beta1, beta2)``.
        eps: Adam's epsilon.
        weight_decay: Decoupled weight decay (as ``torch.optim.AdamW``; default 0.01 like torch, set explicitly).
        sign: Apply ``sign`` to the combined direction (default off).
        replicator: Replicator or name; default ``"full"`` (== torch AdamW on the replica-mean gradient).
        compression: Fraction kept, for a replicator built by name.
        **replicator_options: Options for a replicator built by name.
    """

    default_replicator = "full"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        sign: bool = False,
        replicator: Replicator | str | None = None,
        compression: float = 1 / 32,
        **replicator_options: Any,
    ) -> None:
        _check("lr", lr, 0.0)
        _check("betas[0]", betas[0], 0.0, 1.0)
        _check("betas[1]", betas[1], 0.0, 1.0)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "sign": bool(sign)}
        super().__init__(
            params, defaults, replicator=replicator, compression=compression, replicator_options=replicator_options
        )

    def _adam_direction(self, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Advance the local moments with ``grad``; return ``m_hat / (sqrt(v_hat) + eps)`` (torch AdamW's order)."""
        beta1, beta2 = group["betas"]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        exp_avg = self._buffer(state, "exp_avg", grad)
        exp_avg_sq = self._buffer(state, "exp_avg_sq", grad)
        state["step"] += 1
        step = state["step"].item()
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        return exp_avg.div(denom).div_(bias_correction1)

    def _source(self, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        if self.replicator.exchanges_gradient:
            return grad
        direction = self._adam_direction(state, grad, group)
        return self._buffer(state, "error", grad).add_(direction)

    def _apply(self, state: dict[str, Any], param: torch.Tensor, combined: torch.Tensor, group: dict[str, Any]) -> None:
        if self.replicator.exchanges_gradient:
            combined = self._adam_direction(state, combined, group)
        self._descend(param, combined, group)
