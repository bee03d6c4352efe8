"""Strategy metrics that a callback also logs are left to the callback: one name per meaning, one source.

A strategy reports, for example, its step's inter-node bytes as ``comm/inter/bytes_sent_step``, the name and meaning
of :class:`~lightning_hetero.callbacks.CommunicationMonitor`'s metric (docs/metrics.md). When such a callback is
attached it alone logs the name, so no name is logged from two hooks with two definitions of "the step".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["log_step_metrics", "without_callback_metrics"]


def without_callback_metrics(trainer: Any, metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` less the names a callback of ``trainer`` logs itself (callbacks with ``logs_metric(name)``)."""
    present = [] if trainer is None else trainer.callbacks
    callbacks = [cb for cb in present if callable(getattr(cb, "logs_metric", None))]
    return {name: value for name, value in metrics.items() if not any(cb.logs_metric(name) for cb in callbacks)}


def log_step_metrics(module: Any, metrics: Mapping[str, float]) -> None:
    """Log a strategy's per-step ``metrics`` from ``module`` (rank 0's values), less those a callback logs itself; a
    module outside a Trainer logs nothing."""
    if module is None or module._trainer is None:
        return
    for name, value in without_callback_metrics(module._trainer, metrics).items():
        module.log(name, value, on_step=True, on_epoch=False, batch_size=1, rank_zero_only=True)
