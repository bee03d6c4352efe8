"""The optimizer settings shared by the reference modules: the learning-rate schedule and argument checks."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class WarmupCosineSchedule:
    """LR multiplier: linear warmup, then cosine decay to ``min_lr_ratio``; used as a ``LambdaLR`` lambda.

    ``step`` is the number of optimizer steps already taken. Warmup climbs as ``(step + 1) / (warmup_steps + 1)``
    so that the first step already learns and the peak (1.0) is reached at ``step == warmup_steps``; the cosine then
    reaches exactly ``min_lr_ratio`` at the last step, ``total_steps - 1``. With ``total_steps=None`` (unknown or
    infinite training length) the multiplier stays at 1.0 after warmup.

    A callable object rather than a closure so that ``LambdaLR.state_dict()`` stores its fields in checkpoints.
    """

    warmup_steps: int
    total_steps: int | None
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.total_steps is None:
            return 1.0
        decay_steps = max(1, self.total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def validate_optimizer_arguments(
    learning_rate: float, weight_decay: float, betas: tuple[float, float], warmup_steps: int, min_lr_ratio: float
) -> None:
    """Reject optimizer arguments that cannot train, naming the argument and its accepted range."""
    if not (isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate!r}.")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be >= 0 (0 disables it), got {weight_decay!r}.")
    if len(tuple(betas)) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), e.g. (0.9, 0.95); got {betas!r}.")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}.")
    if not (isinstance(min_lr_ratio, (int, float)) and 0.0 <= min_lr_ratio <= 1.0):
        raise ValueError(f"min_lr_ratio must be in [0, 1] (final fraction of learning_rate), got {min_lr_ratio!r}.")
