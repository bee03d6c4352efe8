"""Types shared by the MatFormer building blocks (adapters, slicing, aggregation)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FFNParameter:
    """A parameter with one axis along an FFN hidden (intermediate) dimension.

    A rank at tier ``t`` holds (or trains) the prefix ``[0, width)`` of that axis, ``width = full_size >> t`` unless
    per-layer widths say otherwise. Parameters of the model that are not listed are shared by every rank whole.
    """

    name: str
    """Parameter name in the full (tier-0) model, as in ``model.named_parameters()``."""
    axis: int
    """The axis that runs along the hidden dimension (0 for up/gate rows and their biases, 1 for down columns;
    GPT-2's transposed ``Conv1D`` flips these)."""
    full_size: int
    """Size of that axis in the full model (the tier-0 intermediate size ``h``)."""
    layer: int
    """Index of the transformer block the FFN belongs to (for per-layer widths)."""


def tier_width(full_size: int, tier: int) -> int:
    """Width ``h / 2**tier`` of a tier; raises if ``tier`` is negative or does not divide ``full_size`` evenly."""
    if tier < 0:
        raise ValueError(f"tier must be >= 0, got {tier}.")
    if full_size % (1 << tier):
        raise ValueError(
            f"tier {tier} needs the FFN size {full_size} to be divisible by 2**{tier} = {1 << tier}; use a lower tier."
        )
    return full_size >> tier
