"""Turning the user's optimizer into a replicating one: AdamW/Adam -> DecoupledAdamW, SGD -> DeMoSGD.

The strategy builds its optimizers after sharding (parameters are then FSDP2 DTensors) and converts them here,
keeping the param groups (and every per-group hyperparameter, plus ``initial_lr`` of an LR scheduler) as they are. An
optimizer that already is a :class:`~lightning_hetero.flexdemo.replicating.ReplicatingOptimizer` is used as given.
LR schedulers built on the original optimizer are re-pointed with :func:`repoint_scheduler`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import wraps
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_hetero.flexdemo.optim import DecoupledAdamW, DeMoSGD
from lightning_hetero.flexdemo.replicating import ReplicatingOptimizer

__all__ = ["SUPPORTED_OPTIMIZERS", "convert_optimizer", "repoint_scheduler"]

log = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS = (
    "torch.optim.AdamW or torch.optim.Adam (converted to DecoupledAdamW), torch.optim.SGD (converted to DeMoSGD), or "
    "a ReplicatingOptimizer (DeMoSGD, DecoupledAdamW) from lightning_hetero.flexdemo"
)

# torch implementation switches that have no meaning for the replicating optimizers (dropped from param groups).
_TORCH_ONLY_KEYS = frozenset(
    {
        "amsgrad",
        "maximize",
        "foreach",
        "capturable",
        "differentiable",
        "fused",
        "decoupled_weight_decay",
        "dampening",
        "nesterov",
    }
)


def convert_optimizer(
    optimizer: Optimizer,
    make_replicator: Callable[[], Any],
    owner: str = "FlexDeMoStrategy",
    *,
    adamw_exchange: str,
    preconditioner_beta2: float | None,
) -> tuple[ReplicatingOptimizer, str]:
    """A replicating optimizer with the same param groups and hyperparameters as ``optimizer``.

    Args:
        optimizer: The user's optimizer (no state yet).
        make_replicator: Builds the strategy's replicator for a converted optimizer.
        owner: Name used in messages.
        adamw_exchange: ``FlexDeMoSettings.adamw_exchange`` (no default here: the settings hold it), the ``exchange`` of
            a ``DecoupledAdamW`` converted from AdamW/Adam (``"direction"``,
            ``"preconditioned"`` or ``"gradient"``; see :class:`~lightning_hetero.flexdemo.optim.DecoupledAdamW`).
        preconditioner_beta2: With ``adamw_exchange="preconditioned"`` and a compressing replicator, the ``beta2``
            of every converted param group (``beta1`` kept, unused in that mode); None keeps the optimizer's own.
            Full and DiLoCo replication run the user's AdamW as it is and keep its ``beta2``.

    Returns:
        ``(optimizer, description)``; ``optimizer`` is the input itself when it already replicates.

    Raises:
        ValueError: an unsupported optimizer class or option (amsgrad, maximize, nesterov, dampening), or an
            optimizer that already holds state.
    """
    if isinstance(optimizer, ReplicatingOptimizer):
        return optimizer, f"{type(optimizer).__name__} used as given (its own replicator)"
    name = type(optimizer).__name__
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
        raise ValueError(f"{owner} cannot use the optimizer {name}: supported are {SUPPORTED_OPTIMIZERS}.")
    if any(optimizer.state.values()):
        raise ValueError(
            f"{owner}: the {name} optimizer already holds state; return a fresh optimizer from configure_optimizers "
            "(it is converted before the first step)."
        )
    groups = optimizer.param_groups
    _reject_options(optimizer, owner)
    override = ""
    if isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam in torch 2.13
        coupled = not groups[0].get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        if coupled and any(g["weight_decay"] for g in groups):
            log.warning(
                "%s: Adam's weight decay is an L2 term added to the gradient; DecoupledAdamW decays the weights "
                "directly (AdamW-style) with the same coefficient.",
                owner,
            )
        first = groups[0]
        replicator = make_replicator()
        clean = _clean_groups(groups)
        preconditioned = adamw_exchange == "preconditioned" and not replicator.exchanges_gradient
        if preconditioner_beta2 is not None and preconditioned:
            old = sorted({float(group["betas"][1]) for group in clean})
            for group in clean:
                group["betas"] = (group["betas"][0], preconditioner_beta2)
            if old != [preconditioner_beta2]:
                shown = ", ".join(f"{beta:g}" for beta in old)
                override = f"; beta2 {shown} -> {preconditioner_beta2:g} (preconditioner_beta2)"
        converted: ReplicatingOptimizer = DecoupledAdamW(
            clean,
            lr=_scalar(first["lr"]),
            betas=tuple(clean[0]["betas"]),
            eps=first["eps"],
            weight_decay=first["weight_decay"],
            exchange=adamw_exchange,
            replicator=replicator,
        )
    else:
        first = groups[0]
        clean = _clean_groups(groups)
        for group in clean:
            if not group.get("momentum"):
                group.pop("momentum", None)  # SGD's 0: DeMoSGD's own decay instead (0 would drop the residual)
        converted = DeMoSGD(
            clean,
            lr=_scalar(first["lr"]),
            weight_decay=first["weight_decay"],
            replicator=make_replicator(),
            **({"momentum": first["momentum"]} if first.get("momentum") else {}),
        )
    description = f"{name} converted to {type(converted).__name__} ({len(groups)} param group(s)){override}"
    log.info("%s: %s.", owner, description)
    return converted, description


def _reject_options(optimizer: Optimizer, owner: str) -> None:
    name = type(optimizer).__name__
    for index, group in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize", "nesterov"):
            if group.get(key):
                raise ValueError(
                    f"{owner}: {name}({key}=True) in param group {index} has no replicating equivalent; drop {key} "
                    f"or pass a ReplicatingOptimizer. Supported: {SUPPORTED_OPTIMIZERS}."
                )
        if group.get("dampening"):
            raise ValueError(f"{owner}: SGD(dampening={group['dampening']}) is not supported by DeMoSGD; use 0.")


def _clean_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups without torch's implementation switches (user keys and ``initial_lr`` stay)."""
    return [{k: v for k, v in group.items() if k not in _TORCH_ONLY_KEYS} for group in groups]


def _scalar(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def repoint_scheduler(scheduler: Any, old: Optimizer, new: Optimizer) -> bool:
    """Make an LR scheduler built on ``old`` drive ``new`` (returns whether it pointed at ``old``).

    The param groups were copied with their ``lr`` and ``initial_lr``, so the schedule continues unchanged. The
    ``step`` wrapper torch's schedulers install (to warn about ``scheduler.step()`` before ``optimizer.step()``) is
    installed on ``new`` too.
    """
    if getattr(scheduler, "optimizer", None) is not old:
        return False
    scheduler.optimizer = new
    if not hasattr(new.step, "_wrapped_by_lr_sched"):
        step = new.step

        @wraps(step)
        def counted_step(*args: Any, **kwargs: Any) -> Any:
            new._opt_called = True  # type: ignore[attr-defined]
            return step(*args, **kwargs)

        counted_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        new.step = counted_step  # type: ignore[method-assign]
    return True
