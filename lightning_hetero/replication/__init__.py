"""Replicators: how the local update of each replica is exchanged over the replicate (inter-node) group.

The floor that FlexDeMo's optimizers and MatFormer's ``demo`` aggregation both build on: the chunked DCT
(:mod:`~lightning_hetero.replication.transforms`) and the replicators (:mod:`~.base`, :mod:`~.sparse`, :mod:`~.dense`,
:mod:`~.diloco`). It imports only torch and :mod:`lightning_hetero.comm`, never a method package.
:class:`~.settings.ReplicationSettings` holds a replicator's typed settings and builds it
(``ReplicationSettings(kind="demo", kept_fraction=1/32).build()``); ``build_replicator(name, kept_fraction, **options)``
builds one by name for the optimizers' own keyword arguments; :data:`REPLICATORS` maps names to classes.
See ``docs/flexdemo.md`` for the math and the payload formulas.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning_hetero.replication.base import Bucket, Piece, Replicator, kept_count, validate_kept_fraction
from lightning_hetero.replication.dense import (
    FullReplicator,
    RandomReplicator,
    StridingReplicator,
    coordinate_schedule,
)
from lightning_hetero.replication.diloco import DiLoCoReplicator
from lightning_hetero.replication.settings import REPLICATORS, ReplicationSettings
from lightning_hetero.replication.sparse import COMBINE_MODES, DeMoReplicator, TopKReplicator

__all__ = [
    "COMBINE_MODES",
    "REPLICATORS",
    "Bucket",
    "DeMoReplicator",
    "DiLoCoReplicator",
    "FullReplicator",
    "Piece",
    "RandomReplicator",
    "ReplicationSettings",
    "Replicator",
    "StridingReplicator",
    "TopKReplicator",
    "build_replicator",
    "coordinate_schedule",
    "kept_count",
    "validate_kept_fraction",
]


def build_replicator(name: str, kept_fraction: float = 1 / 32, **options: Any) -> Replicator:
    """Build the replicator registered as ``name``.

    Args:
        name: One of :data:`REPLICATORS` (``"demo"``, ``"random"``, ``"striding"``, ``"diloco"``, ``"full"``,
            ``"topk"``), case-insensitive.
        kept_fraction: Fraction of coefficients kept, in ``(0, 1]`` (ignored by ``"full"``; sets DiLoCo's default
            ``sync_every = round(1 / kept_fraction)``).
        **options: Replicator options: ``values``, ``seed``; ``chunk``, ``index_bits``, ``combine`` (demo, topk);
            ``sync_every``, ``outer_lr``, ``outer_momentum`` (diloco). Options set to None are dropped (the
            replicator's default applies), so a strategy can pass one flat set of options; any other option the
            replicator does not take raises.

    Raises:
        ValueError: Unknown name or option, or an invalid value (kept_fraction, chunk, index_bits, values, ...).
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in REPLICATORS:
        raise ValueError(f"replicator must be one of {sorted(REPLICATORS)}, got {name!r}.")
    cls = REPLICATORS[key]
    options = {option: value for option, value in options.items() if value is not None}
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "kept_fraction"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(
            f"replicator {key!r} does not take option(s) {unknown}; it accepts {sorted(accepted)} (and kept_fraction)."
        )
    return cls(kept_fraction, **options)
