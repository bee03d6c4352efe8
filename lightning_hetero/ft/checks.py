"""Nothing a peer sends on the fault-tolerant path is applied unchecked: the combined update and a recovered state.

**Combined update** (:func:`combine_contributions`): the authenticated per-replica contributions of a mean or sum
(gradients, a reduce wire) are checked one by one before they are combined. A contribution is left out, on every
replica alike (every replica holds the same authenticated bytes), when

- it holds a NaN/Inf or a value above :data:`~lightning_hetero.comm.validation.MAX_PEER_MAGNITUDE`, or
- **the outlier rule**: with 3 or more valid contributions, its L2 norm exceeds ``outlier_factor`` times the median
  of their norms (median > 0). One hostile or diverged member cannot scale the update by more than about
  ``outlier_factor / n`` of an honest one's; with 2 participants the median is their mean and the rule cannot fire.

The rest are summed in slot order (the same order, the same bits everywhere) and the result is checked again
(finite, bounded); if no contribution is left, :class:`~lightning_hetero.comm.validation.PeerPayloadError` is raised.

**Recovered state** (:func:`validate_recovered`), on the whole state a joining replica received, after the codec's
structural checks and before any of it is applied:

- torchft's ``step`` equals the step the quorum asked for (its max step); ``batches_committed`` and every entry named
  ``step`` (Adam's per-parameter step, the replicator's step counter) are whole numbers >= 0;
- optimizer moments in range: ``exp_avg_sq``, ``max_exp_avg_sq``, ``square_avg``, ``sum``, ``acc_delta``,
  ``exp_inf`` >= 0 (finiteness is the codec's);
- hyper-parameters equal to the joiner's own: every key of every param group (``params``, ``betas``, ``eps``,
  ``weight_decay``, ...) as the joiner holds it, except what an LR scheduler moves: ``lr`` when the group holds
  ``initial_lr`` may be in ``[0, LR_SCHEDULE_HEADROOM x max(lr, initial_lr, max_lr)]`` of the joiner's group, and
  ``momentum`` / ``betas[0]`` in ``[0, 1]`` when it holds ``max_momentum`` (a cycling scheduler);
- RNG states valid: each is loaded into a fresh generator (never the live one) and must load.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError

__all__ = [
    "LR_SCHEDULE_HEADROOM",
    "NON_NEGATIVE_STATE",
    "Combined",
    "combine_contributions",
    "validate_recovered",
]

LR_SCHEDULE_HEADROOM = 10.0
"""How far above the joiner's own largest LR (``lr``, ``initial_lr``, ``max_lr``) a scheduled peer LR may be."""
NON_NEGATIVE_STATE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf"})
"""Per-parameter optimizer state that is a sum of squares or magnitudes in torch's optimizers: never negative."""
_SCHEDULED_MOMENTUM = ("momentum", "betas")


@dataclass
class Combined:
    """The sum of the kept contributions, which slots were kept, and why the others were left out."""

    total: torch.Tensor
    kept: list[int]
    refused: dict[int, str] = field(default_factory=dict)


def combine_contributions(
    contributions: Sequence[torch.Tensor], *, outlier_factor: float, names: Sequence[str] | None = None
) -> Combined:
    """Check every contribution, leave out the invalid ones and a single outlier, sum the rest in slot order.

    Args:
        contributions: One floating-point tensor per participant slot, all of one shape.
        outlier_factor: The outlier rule's factor (0: off); see the module docstring.
        names: How to name each slot in messages (default ``slot <i>``).

    Raises:
        PeerPayloadError: No contribution is left, or the combination is not finite / above the bound.
    """
    labels = list(names) if names is not None else [f"slot {i}" for i in range(len(contributions))]
    refused: dict[int, str] = {}
    norms: dict[int, float] = {}
    outliers = bool(outlier_factor) and len(contributions) >= 3
    for index, values in enumerate(contributions):
        flat = values.detach()
        largest = 0.0
        if flat.numel():
            low, high = torch.aminmax(flat)  # one pass; NaN propagates, so a non-finite value shows here
            largest = max(-float(low), float(high))
        if not math.isfinite(largest):
            refused[index] = f"{labels[index]} holds NaN/Inf"
            continue
        if largest > MAX_PEER_MAGNITUDE:
            refused[index] = f"{labels[index]} holds a value of magnitude {largest:.3g} > {MAX_PEER_MAGNITUDE:.3g}"
            continue
        norms[index] = (
            float(torch.linalg.vector_norm(flat.float() / largest)) * largest if outliers and largest else 0.0
        )
    if outliers and len(norms) >= 3:
        median = statistics.median(norms.values())
        if median > 0:
            for index, norm in list(norms.items()):
                if norm > outlier_factor * median:
                    refused[index] = (
                        f"{labels[index]} has norm {norm:.3g}, above {outlier_factor:g} x the median norm {median:.3g}"
                        " (outlier rule)"
                    )
                    del norms[index]
    kept = sorted(norms)
    if not kept:
        raise PeerPayloadError(
            f"no contribution is usable ({'; '.join(refused.values())}); the step is discarded.", None, "combined"
        )
    total = contributions[kept[0]].detach().clone()
    for index in kept[1:]:
        total += contributions[index]
    if total.numel():
        low, high = torch.aminmax(total)
        largest = max(-float(low), float(high))
        if not math.isfinite(largest):
            raise PeerPayloadError("the combined update is not finite; the step is discarded.", None, "combined")
        if largest > MAX_PEER_MAGNITUDE:
            raise PeerPayloadError("the combined update is above the bound; the step is discarded.", None, "combined")
    return Combined(total, kept, refused)


# ------------------------------------------------------------------------------------------------ recovery
def _refuse(peer: int | None, where: str, message: str) -> PeerPayloadError:
    return PeerPayloadError(f"recovery checkpoint from replica {peer}: {where} {message}; refusing it.", peer, where)


def _whole(value: Any) -> float | None:
    """``value`` (a number or a one-element tensor) as a float, or None when it is neither."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().reshape(-1)[0]) if value.numel() == 1 else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _check_step(value: Any, where: str, peer: int | None) -> None:
    number = _whole(value)
    if number is None or not math.isfinite(number) or number < 0 or number != int(number):
        raise _refuse(peer, where, f"is {value!r}, not a whole number >= 0")


def _walk_steps(value: Any, path: str, peer: int | None) -> None:
    """Every entry named ``step`` anywhere below ``value`` is a whole number >= 0."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}/{key}"
            if key == "step":
                _check_step(item, where, peer)
            else:
                _walk_steps(item, where, peer)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _walk_steps(item, f"{path}/{index}", peer)


def _same(mine: Any, theirs: Any) -> bool:
    if isinstance(mine, torch.Tensor) or isinstance(theirs, torch.Tensor):
        return isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and torch.equal(mine, theirs)
    if isinstance(mine, (list, tuple)):
        return isinstance(theirs, (list, tuple)) and len(mine) == len(theirs) and all(map(_same, mine, theirs))
    return type(mine) is type(theirs) and mine == theirs


def _check_group(index: int, mine: Mapping[str, Any], theirs: Mapping[str, Any], peer: int | None, path: str) -> None:
    for key, own in mine.items():
        value = theirs.get(key)
        where = f"{path}/param_groups/{index}/{key}"
        if key == "lr" and "initial_lr" in mine:
            ceiling = LR_SCHEDULE_HEADROOM * max(
                abs(_whole(mine.get(name)) or 0.0) for name in ("lr", "initial_lr", "max_lr")
            )
            number = _whole(value)
            if number is None or not 0 <= number <= ceiling:
                raise _refuse(peer, where, f"is {value!r}, outside [0, {ceiling:g}] (the joiner's schedule)")
            continue
        if key in _SCHEDULED_MOMENTUM and "max_momentum" in mine:
            first = value[0] if key == "betas" and isinstance(value, (list, tuple)) and value else value
            number = _whole(first)
            if number is None or not 0 <= number <= 1 or (key == "betas" and not _same(own[1:], value[1:])):
                raise _refuse(peer, where, f"is {value!r}, not a scheduled momentum in [0, 1]")
            continue
        if not _same(own, value):
            raise _refuse(peer, where, f"is {str(value)[:80]}, this replica is configured with {str(own)[:80]}")


def _check_optimizer(mine: Mapping[str, Any], theirs: Mapping[str, Any], peer: int | None, path: str) -> None:
    own_groups, groups = mine.get("param_groups", []), theirs.get("param_groups", [])
    if len(own_groups) != len(groups):
        raise _refuse(peer, f"{path}/param_groups", f"has {len(groups)} groups, this replica has {len(own_groups)}")
    for index, (own, group) in enumerate(zip(own_groups, groups, strict=True)):
        _check_group(index, own, group, peer, path)
    for key, entry in (theirs.get("state") or {}).items():
        if not isinstance(entry, Mapping):
            continue
        for name, value in entry.items():
            if name in NON_NEGATIVE_STATE and isinstance(value, torch.Tensor) and value.numel():
                if float(value.detach().float().min()) < 0:
                    raise _refuse(peer, f"{path}/state/{key}/{name}", "holds negative values (a sum of squares)")


def _check_rng(rng: Mapping[str, Any], peer: int | None, path: str) -> None:
    """Load every RNG state into a fresh generator (never the live one): it must load."""
    try:
        if "torch" in rng:
            torch.Generator().set_state(rng["torch"])
        if "python" in rng:
            random.Random().setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.Generator(device="cuda").set_state(rng["cuda"])
    except (TypeError, ValueError, OverflowError, RuntimeError, IndexError) as error:
        raise _refuse(peer, f"{path}/rng", f"is not a valid RNG state ({str(error)[:80]})") from None


def validate_recovered(state: Mapping[str, Any], own: Mapping[str, Any], *, step: int, peer: int | None) -> None:
    """Check a decoded recovery state (``{"user": {"default": ...}, "torchft": ...}``) against the joiner's own.

    Args:
        state: What the codec decoded (structure, dtypes, shapes, finiteness already checked).
        own: The joiner's own state in the same form.
        step: The step the quorum asked for (its max step).
        peer: The source replica, named in errors.

    Raises:
        PeerPayloadError: Anything breaks the rule of the module docstring; nothing has been applied.
    """
    torchft = state.get("torchft", {})
    if _whole(torchft.get("step")) != step or isinstance(torchft.get("step"), bool):
        raise _refuse(peer, "torchft/step", f"is {torchft.get('step')!r}, the quorum's step is {step}")
    _check_step(torchft.get("batches_committed"), "torchft/batches_committed", peer)
    _walk_steps(state.get("user", {}), "user", peer)
    for name, theirs in state.get("user", {}).items():
        mine = own.get("user", {}).get(name, {})
        path = f"user/{name}"
        if isinstance(theirs.get("optimizer"), Mapping):
            _check_optimizer(mine.get("optimizer", {}), theirs["optimizer"], peer, f"{path}/optimizer")
        if isinstance(theirs.get("rng"), Mapping):
            _check_rng(theirs["rng"], peer, path)
