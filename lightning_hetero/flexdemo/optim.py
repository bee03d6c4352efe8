"""Optimizers whose update is exchanged between replicas by a :class:`~lightning_hetero.replication.Replicator`.

Both derive from :class:`~lightning_hetero.flexdemo.replicating.ReplicatingOptimizer`, which owns the ``bind`` /
``launch`` / ``step`` protocol, the overlap of the exchange with backward and the checkpoint format; see
:mod:`lightning_hetero.flexdemo.replicating`.

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
* :class:`DecoupledAdamW` (Adam moments are never sent)
    - compressing replicators, ``exchange="direction"`` (0.1's behaviour): local Adam on g,
      ``d = m_hat / (sqrt(v_hat) + eps)``, ``e <- e + d``, ``u = R(e)`` with ``e <- e - sent`` (error feedback on the
      direction), ``theta <- theta (1 - eta lambda) - eta u`` (``sign=True``: ``sign(u)``). The moments are local:
      each node normalizes its own gradient before anything is combined;
    - compressing replicators, ``exchange="preconditioned"`` (default): local second moment only,
      ``p = g / (sqrt(v_hat) + eps)``, ``e <- e + p``, ``u = R(e)`` with ``e <- e - sent``,
      ``theta <- theta (1 - eta lambda) - eta u``. The error-feedback buffer plays the first moment (DeMo's decoupled
      momentum: what is not sent keeps accumulating), so Adam's ``beta1`` is not applied on top of it; ``"direction"``
      smooths twice (Adam's ``m`` and then the buffer), which measured worse (docs/flexdemo.md);
    - compressing replicators, ``exchange="gradient"``: ``e <- e + g``, ``u = R(e)`` with ``e <- e - sent`` (error
      feedback on the raw gradient), then Adam on ``u`` exactly as in the full case below. ``u`` is identical on every
      replica, so the moments are too (no drift); a replicator that keeps everything gives torch AdamW on the mean
      gradient;
    - full: ``gbar = R(g)`` first, then exactly ``torch.optim.AdamW`` on ``gbar`` (same formula and order:
      decay, ``m.lerp_``, ``v``, bias corrections, ``denom = sqrt(v) / sqrt(bc2) + eps``): with fp32 values
      Full + DecoupledAdamW on ``n`` replicas equals torch AdamW on the replica-mean gradient, and the moments stay
      identical on every replica;
    - diloco: local AdamW on the local gradient, plus the replicator's outer step every ``H`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch

from lightning_hetero.flexdemo.replicating import ReplicatingOptimizer
from lightning_hetero.replication import Replicator

__all__ = ["DeMoSGD", "DecoupledAdamW"]

_EXCHANGES = ("direction", "preconditioned", "gradient")


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
        kept_fraction: Fraction kept, for a replicator built by name.
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
        kept_fraction: float = 1 / 32,
        **replicator_options: Any,
    ) -> None:
        _check("lr", lr, 0.0)
        _check("momentum", momentum, 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "sign": bool(sign)}
        super().__init__(
            params, defaults, replicator=replicator, kept_fraction=kept_fraction, replicator_options=replicator_options
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
        exchange: What a compressing replicator sends: ``"direction"`` (local Adam's update direction, error feedback
            on it), ``"preconditioned"`` (the gradient divided by local Adam's ``sqrt(v_hat) + eps``, error feedback
            on it: the error-feedback buffer is the first moment, as in DeMo, so ``betas[0]`` is not used) or
            ``"gradient"`` (the raw gradient with error feedback; Adam runs on the combined gradient, its moments
            identical on every replica). Full and DiLoCo replication ignore it.
        replicator: Replicator or name; default ``"full"`` (== torch AdamW on the replica-mean gradient).
        kept_fraction: Fraction kept, for a replicator built by name.
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
        exchange: Literal["direction", "preconditioned", "gradient"] = "preconditioned",
        replicator: Replicator | str | None = None,
        kept_fraction: float = 1 / 32,
        **replicator_options: Any,
    ) -> None:
        _check("lr", lr, 0.0)
        if exchange not in _EXCHANGES:
            raise ValueError(f"exchange must be one of {list(_EXCHANGES)}, got {exchange!r}.")
        _check("betas[0]", betas[0], 0.0, 1.0)
        _check("betas[1]", betas[1], 0.0, 1.0)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "sign": bool(sign),
            "exchange": exchange,
        }
        super().__init__(
            params, defaults, replicator=replicator, kept_fraction=kept_fraction, replicator_options=replicator_options
        )
        self.contribution_weight = 1.0
        """This replica's weight in the mean of what the replicas send (a batch share's ``W n_r / N``; 1 without).
        The gradient already carries it (the strategy scales the loss), but the ``"direction"`` and
        ``"preconditioned"`` exchanges divide by the local second moment, which cancels any scale of the gradient:
        they multiply what enters the error-feedback buffer by it again, so the exchanged mean stays token-weighted."""

    def _second_moment_denominator(
        self, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]
    ) -> tuple[torch.Tensor, float]:
        """Advance the step and ``v`` with ``grad``; return ``(sqrt(v_hat) + eps, step)`` (torch AdamW's order)."""
        beta2 = group["betas"][1]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        exp_avg_sq = self._buffer(state, "exp_avg_sq", grad)
        state["step"] += 1
        step = state["step"].item()
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        return (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"]), step

    def _adam_direction(self, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Advance the local moments with ``grad``; return ``m_hat / (sqrt(v_hat) + eps)`` (torch AdamW's order)."""
        beta1 = group["betas"][0]
        exp_avg = self._buffer(state, "exp_avg", grad)
        exp_avg.lerp_(grad, 1 - beta1)  # before v, as torch does (the two are independent)
        denom, step = self._second_moment_denominator(state, grad, group)
        return exp_avg.div(denom).div_(1 - beta1**step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint taken with the same ``exchange`` (the error buffers of the two modes differ).

        Raises:
            ValueError: The checkpoint's ``exchange`` differs from this optimizer's (checkpoints without the key were
                taken in ``"direction"`` mode). Full and DiLoCo ignore ``exchange``, so they are not checked.
        """
        if state_dict.get("state") and not self.replicator.exchanges_gradient:
            for index, (saved, group) in enumerate(zip(state_dict["param_groups"], self.param_groups, strict=False)):
                saved_exchange = saved.get("exchange", "direction")
                if saved_exchange != group["exchange"]:
                    raise ValueError(
                        f"DecoupledAdamW: the checkpoint was trained with exchange={saved_exchange!r} (param group "
                        f"{index}) but this optimizer uses exchange={group['exchange']!r}; its error-feedback buffers "
                        f"mean different things. Resume with exchange={saved_exchange!r} (FlexDeMoSettings."
                        f"adamw_exchange) or start the run afresh."
                    )
        super().load_state_dict(state_dict)

    def _adam_after_exchange(self, group: dict[str, Any]) -> bool:
        """Whether Adam runs on the combined gradient (its moments then identical on every replica)."""
        return self.replicator.exchanges_gradient or group["exchange"] == "gradient"

    def _source(self, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        if self.replicator.exchanges_gradient:
            return grad
        if self._adam_after_exchange(group):
            return self._buffer(state, "error", grad).add_(grad)
        if group["exchange"] == "preconditioned":  # the error-feedback buffer is the first moment: no beta1 here
            direction = grad / self._second_moment_denominator(state, grad, group)[0]
        else:
            direction = self._adam_direction(state, grad, group)
        return self._buffer(state, "error", grad).add_(direction, alpha=self.contribution_weight)

    def _apply(self, state: dict[str, Any], param: torch.Tensor, combined: torch.Tensor, group: dict[str, Any]) -> None:
        if self._adam_after_exchange(group):
            combined = self._adam_direction(state, combined, group)
        self._descend(param, combined, group)
