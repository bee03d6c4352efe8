"""AdamW that keeps subspace-constrained weights inside span(U) (projected mode).

Adam's elementwise step ``m / (sqrt(v) + eps)`` rescales each coordinate of a column differently, which rotates a
column out of span(U) even when ``m`` lies in it. Sharing the adaptive denominator along the constrained axis (one
value per input column for an ``(d, d_in)`` weight, one per token row for a ``(V, d)`` embedding) makes the step
``(U U^T M) diag(1/denominator)``, which stays in span(U). The shared second moment is the mean over the constrained
axis of ``g^2`` (the paper's "row-wise mean"), stored reduced (``(1, d_in)`` / ``(V, 1)``), so it also costs less
memory. Decoupled weight decay ``W <- (1 - lr*wd) W`` keeps the span too. Gradients must already be projected
(``StageModule.project_gradients_``) -- the first moment then stays in the span.

Other parameters get the standard AdamW update (same formula as ``torch.optim.AdamW``, single-tensor path).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["SubspaceAdamW", "project_along", "reproject_parameter_", "rotate_parameter_"]


class SubspaceAdamW(Optimizer):
    """AdamW with a shared adaptive denominator along each constrained parameter's subspace axis.

    Args:
        params: Parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: As ``torch.optim.AdamW`` (decoupled weight decay).
        constrained: Parameter -> axis (of size ``d``) along which it lies in span(U); typically
            ``stage.constrained_parameters()``. Parameters not listed are updated by plain AdamW.

    Example::

        optimizer = SubspaceAdamW(stage.parameters(), lr=3e-4, constrained=stage.constrained_parameters())
        loss.backward(); stage.project_gradients_(); optimizer.step()
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        constrained: Mapping[Tensor, int] | None = None,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"SubspaceAdamW: lr={lr} must be >= 0.")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"SubspaceAdamW: betas={betas} must lie in [0, 1).")
        if not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"SubspaceAdamW: eps={eps} and weight_decay={weight_decay} must be >= 0.")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self._axes: dict[int, int] = {}
        known = {id(p) for group in self.param_groups for p in group["params"]}
        for parameter, axis in (constrained or {}).items():
            if id(parameter) not in known:
                raise ValueError("SubspaceAdamW: a constrained parameter is not among the optimized params.")
            if not -parameter.dim() <= axis < parameter.dim():
                raise ValueError(f"SubspaceAdamW: axis {axis} is out of range for a {parameter.dim()}-d parameter.")
            self._axes[id(parameter)] = axis % parameter.dim()

    def constrained_axis(self, parameter: Tensor) -> int | None:
        """The shared axis of ``parameter``, or None when it is updated by plain AdamW."""
        return self._axes.get(id(parameter))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step; constrained parameters use the shared denominator."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for parameter in group["params"]:
                grad = parameter.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("SubspaceAdamW does not support sparse gradients.")
                axis = self._axes.get(id(parameter))
                state = self.state[parameter]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                    shape = list(parameter.shape)
                    if axis is not None:
                        shape[axis] = 1  # one second moment shared along the subspace axis
                    state["exp_avg_sq"] = torch.zeros(shape, dtype=parameter.dtype, device=parameter.device)
                step_t = state["step"]
                step_t += 1
                step = int(step_t.item())
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                parameter.mul_(1 - lr * weight_decay)
                exp_avg.lerp_(grad, 1 - beta1)
                squared = grad * grad
                if axis is not None:
                    squared = squared.mean(dim=axis, keepdim=True)
                exp_avg_sq.mul_(beta2).add_(squared, alpha=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2_sqrt = (1 - beta2**step) ** 0.5
                denominator = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                parameter.addcdiv_(exp_avg, denominator, value=-lr / bias_correction1)
        return loss


# Re-expressing parameters and optimizer moments in a new basis (used by StageModule.rebase_).


def project_along(tensor: Tensor, basis: Tensor, axis: int) -> Tensor:
    """``U U^T`` applied along ``axis`` (the dimension of size d whose vectors should lie in span(U))."""
    u = basis.to(tensor.dtype)
    moved = tensor.movedim(axis, 0)
    flat = moved.reshape(moved.shape[0], -1)
    return (u @ (u.T @ flat)).reshape(moved.shape).movedim(0, axis)


def _apply_along(tensor: Tensor, matrix: Tensor, axis: int) -> Tensor:
    moved = tensor.to(matrix.dtype).movedim(axis, 0)
    flat = moved.reshape(moved.shape[0], -1)
    return (matrix @ flat).reshape(moved.shape).movedim(0, axis).to(tensor.dtype)


_FIRST_MOMENTS = ("exp_avg", "momentum_buffer")
_SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")


def rotate_parameter_(parameter: nn.Parameter, rotation: Tensor, axis: int, optimizer: Optimizer | None) -> None:
    """Coordinates ``x <- R x`` along ``axis`` (reparam rebase); first moments likewise, second moments ``(R*R) v``
    (the diagonal approximation: exact only for a diagonal R). Other optimizer state of the parameter's shape warns."""
    parameter.copy_(_apply_along(parameter, rotation, axis))
    state = optimizer.state.get(parameter, {}) if optimizer is not None else {}
    for key, value in state.items():
        if not torch.is_tensor(value) or value.shape != parameter.shape:
            continue
        if key in _FIRST_MOMENTS:
            value.copy_(_apply_along(value, rotation, axis))
        elif key in _SECOND_MOMENTS:
            value.copy_(_apply_along(value, rotation * rotation, axis))
        else:
            warnings.warn(f"rebase_: optimizer state {key!r} is left in the old basis.", UserWarning, stacklevel=3)


def reproject_parameter_(parameter: nn.Parameter, basis: Tensor, axis: int, optimizer: Optimizer | None) -> None:
    """Dense ``W <- U U^T W`` along ``axis`` (projected rebase) and the first moments likewise; second moments, which
    SubspaceAdamW shares along ``axis``, are kept."""
    projector = basis @ basis.T
    parameter.copy_(_apply_along(parameter, projector, axis))
    state = optimizer.state.get(parameter, {}) if optimizer is not None else {}
    for key in _FIRST_MOMENTS:
        value = state.get(key)
        if torch.is_tensor(value) and value.shape == parameter.shape:
            value.copy_(_apply_along(value, projector, axis))
