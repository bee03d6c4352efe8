"""Process groups of tiered MatFormer training: one per distinct rank set that shares an FFN region.

:class:`RegionGroups` is built once at setup and used by
:func:`~lightning_hetero.matformer.aggregate.aggregate_gradients` and
:class:`~lightning_hetero.matformer.compressed.CompressedExchange`. :class:`GradientExchange` is what the aggregation
needs from a compressed exchange, so that neither of those two modules has to import the other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_hetero import comm
from lightning_hetero.comm import INTER, ByteLedger
from lightning_hetero.comm.devices import collective_device
from lightning_hetero.matformer.helper_ranks import HelperConfig, validate_helpers
from lightning_hetero.matformer.layout import TierLayout
from lightning_hetero.matformer.regions import Region, layer_regions

__all__ = ["GradientExchange", "RegionGroups"]


class RegionGroups:
    """One process group per distinct rank set that shares a region, created identically on every rank.

    Every rank must construct this, with the same arguments and in the same order relative to other
    ``torch.distributed.new_group`` calls (``new_group`` is collective over the whole world), after
    ``init_process_group`` and before the first :func:`~lightning_hetero.matformer.aggregate.aggregate_gradients`.
    Rank sets are created largest first, ties by rank tuple; the all-ranks set uses the default group and
    single-rank sets need no group at all.

    Args:
        layout: Widths of every rank in every layer.
        helpers: Helper configs by rank (see :class:`~lightning_hetero.matformer.helper_ranks.HelperConfig`);
            helpers join the groups of the regions in their tail, so they change the rank sets.
        label: Ledger label of the exchange (``"inter"``: the slow link between nodes).
        backend: Backend for the new groups (default: the world's).
        verify: All-reduce a 16-byte fingerprint of ``(layout, helpers)`` once, so that ranks configured
            differently fail here with a clear error instead of hanging or mixing wrong regions later.
        ledger: Ledger that records the verification (default: the global one).
    """

    def __init__(
        self,
        layout: TierLayout,
        *,
        helpers: Mapping[int, HelperConfig] | None = None,
        label: str = INTER,
        backend: str | None = None,
        verify: bool = True,
        ledger: ByteLedger | None = None,
    ) -> None:
        comm.validate_label(label)
        self.layout = layout
        self.helpers = validate_helpers(layout, helpers)
        self.label = label
        initialized = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        if world_size != layout.world_size:
            raise ValueError(
                f"layout describes {layout.world_size} ranks but the world has {world_size}; give one tier or width"
                " list entry per rank" + ("" if initialized else " (or call torch.distributed.init_process_group)")
            )
        self._regions = {column: layer_regions(layout, column, self.helpers) for column in layout.columns()}
        everyone = tuple(range(world_size))
        member_sets = {region.members for found in self._regions.values() for region in found} | {everyone}
        self.member_sets: tuple[tuple[int, ...], ...] = tuple(sorted(member_sets, key=lambda s: (-len(s), s)))
        """Every rank set that exchanges something, in creation order."""
        self._groups: dict[tuple[int, ...], Any] = {}
        for members in self.member_sets:
            if 1 < len(members) < world_size:
                self._groups[members] = dist.new_group(list(members), backend=backend)
        if verify and world_size > 1:
            self._verify(ledger)

    def regions(self, layer: int = 0) -> list[Region]:
        """The regions of ``layer`` (helpers included)."""
        return self._regions[self.layout.column(layer)]

    def group(self, members: tuple[int, ...]) -> Any | None:
        """Process group of a rank set (None: the default group, or a single rank that needs none)."""
        if members not in self.member_sets:
            raise KeyError(f"no process group for ranks {members}; known rank sets: {list(self.member_sets)}.")
        return self._groups.get(members)

    def _verify(self, ledger: ByteLedger | None) -> None:
        digest = hashlib.sha256(repr((self.layout, sorted(self.helpers.items()))).encode()).digest()
        fingerprint = int.from_bytes(digest[:7], "little")
        # On the backend's device: under NCCL a CPU tensor would fail before any rank could compare fingerprints.
        both = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=collective_device())
        comm.all_reduce(both, "max", label=self.label, ledger=ledger)
        if both.tolist() != [fingerprint, -fingerprint]:
            raise ValueError(
                f"rank {self.rank}: the ranks were given different layouts or helpers (this rank has {self.layout}"
                f" and helpers {self.helpers}); every rank must build RegionGroups from the same configuration."
            )


class GradientExchange(Protocol):
    """A bucket exchange that replaces the all-reduce of ``aggregate_gradients(mode="demo")``.

    :class:`~lightning_hetero.matformer.compressed.CompressedExchange` is the implementation.
    """

    groups: RegionGroups
    """The region groups the exchange was built on."""

    def launch(self, members: tuple[int, ...], contribution: torch.Tensor, shapes: Sequence[torch.Size]) -> Any:
        """Start exchanging one flat bucket among ``members``; returns the handle :meth:`finish` takes."""
        ...

    def finish(self, launched: Any, views: Sequence[torch.Tensor]) -> None:
        """Wait for a launched bucket and write the (weighted) sum of every slab into ``views``."""
        ...
