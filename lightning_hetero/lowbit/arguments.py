"""Argument checks of the ``sparseflip`` strategies: every bad value fails when the strategy is constructed."""

from __future__ import annotations

import math
from typing import Any

from lightning_hetero.comm import codecs
from lightning_hetero.lowbit.sparse import EXCHANGE_MODES

__all__ = ["FLIP_RULES", "NONFINITE_POLICIES", "check_arguments"]

FLIP_RULES = ("local_bop", "bop", "topk")
"""How the aggregated code gradient becomes flips (see :mod:`lightning_hetero.lowbit.rules`)."""
NONFINITE_POLICIES = ("raise", "skip")
"""What a step with a non-finite code gradient does: raise on every rank, or skip the flips (and warn)."""


def check_arguments(
    owner: str,
    *,
    kind: str,
    granularity: str,
    flip_rule: str,
    flips_per_step: Any,
    flip_fraction: Any,
    bop_gamma: Any,
    bop_threshold: Any,
    bop_decay_to: Any,
    zero_fraction: Any,
    tau: Any,
    density: Any,
    encoding: str,
    aggregation: str,
    server: Any,
    drift_check_every: Any,
    on_nonfinite: str,
    fp_density: Any,
) -> None:
    """Raise a ValueError naming the argument and the fix for the first bad value."""
    if kind not in ("ternary", "binary"):
        raise ValueError(f"{owner}(kind={kind!r}): use 'ternary' or 'binary'.")
    if granularity not in ("row", "layer"):
        raise ValueError(f"{owner}(granularity={granularity!r}): use 'row' or 'layer'.")
    if flips_per_step is not None and (
        isinstance(flips_per_step, bool) or not isinstance(flips_per_step, int) or flips_per_step < 1
    ):
        raise ValueError(f"{owner}(flips_per_step={flips_per_step!r}): use an int >= 1, or None for a fraction.")
    if flip_fraction is not None and not (isinstance(flip_fraction, (int, float)) and 0 < flip_fraction <= 1):
        raise ValueError(f"{owner}(flip_fraction={flip_fraction!r}): use a number in (0, 1], or None.")
    if flip_rule not in FLIP_RULES:
        raise ValueError(f"{owner}(flip_rule={flip_rule!r}): use one of {list(FLIP_RULES)}.")
    for name, value, low, high in (
        ("bop_gamma", bop_gamma, 0.0, 1.0),
        ("bop_threshold", bop_threshold, 0.0, math.inf),
        ("bop_decay_to", bop_decay_to, 0.0, 1.0),
    ):
        if not (isinstance(value, (int, float)) and low < value <= high) and not (
            name == "bop_decay_to" and value == 0
        ):
            raise ValueError(f"{owner}({name}={value!r}): use a number in ({low}, {high}].")
    if zero_fraction is not None and not (isinstance(zero_fraction, (int, float)) and 0 <= zero_fraction < 1):
        raise ValueError(f"{owner}(zero_fraction={zero_fraction!r}): use a number in [0, 1), or None.")
    if tau is not None and density is not None:
        raise ValueError(f"{owner}: give tau (a fixed threshold) or density (a fraction sent), not both.")
    if tau is not None and not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau >= 0):
        raise ValueError(f"{owner}(tau={tau!r}): use a finite number >= 0.")
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
        raise ValueError(f"{owner}(fp_density={fp_density!r}): use a number in (0, 1], or None for a dense average.")
    try:
        codecs.validate_value_encoding(encoding)
    except ValueError as error:
        raise ValueError(f"{owner}(encoding={encoding!r}): {error}") from None
