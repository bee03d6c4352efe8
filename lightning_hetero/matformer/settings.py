"""The settings of tiered MatFormer training, declared once: :class:`MatFormerSettings`.

:class:`~lightning_hetero.matformer.runtime.MatFormerRuntime` takes them, and both Lightning adapters
(``lightning_hetero.MatFormerStrategy`` for the Trainer, ``lightning_hetero.fabric.MatFormerStrategy`` for Fabric)
take them as their ``settings`` argument, so a YAML sets each value once under ``init_args.settings`` and LightningCLI
documents it once. Every field is checked when the object is built; what needs the launch (one tier entry per rank or
per node, entries that fit the model's FFNs) is checked by the runtime at launch and setup.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from lightning_hetero.core.settings import check_choice, check_int, check_nested
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.hetero.batch_share import check_batch_share
from lightning_hetero.hetero.tier_settings import AutoTierSettings
from lightning_hetero.replication.settings import ReplicationSettings

__all__ = [
    "DEFAULT_SETTINGS",
    "AggregationMode",
    "MatFormerSettings",
    "TierEntry",
    "as_list",
    "expand_entries",
    "node_entry",
]

TierEntry = int | list[int]
"""One rank's (or node's) tier or width: one value for every FFN, or one per FFN (Mix'n'Match)."""

AggregationMode = Literal["mean", "sign", "demo"]
"""How the gradients of one nested region are combined among the ranks that hold it."""

_OWNER = "MatFormerSettings"


@dataclass(frozen=True, kw_only=True)
class MatFormerSettings:
    """Tiered MatFormer data parallelism: every rank trains its own FFN prefix of one shared model.

    A tier-``t`` rank trains the first ``h >> t`` hidden units of every FFN (or one width per FFN, Mix'n'Match);
    gradients are combined per nested region among exactly the ranks that hold it. Global rank 0 trains the full
    model (tier 0): it is what checkpoints and exports hold.

    Attributes:
        tiers: One entry per global rank (``[0, 0, 1, 2]``) or per node (every rank of node ``k`` gets
            ``tiers[k]``); an entry is a tier ``t`` (FFN width ``h >> t``) or a list with one tier per FFN
            (Mix'n'Match). The first entry must be tier 0. None (and no ``widths``): every rank trains tier 0, which
            is plain data parallelism. ``TierEvaluation`` and ``TierExport`` read their tiers from here when not
            given their own. ``"auto"``: chosen at fit start from every rank's measured step time and peak memory
            (see ``auto_tiers`` and docs/matformer.md, "Tiers from measurement").
        widths: Like ``tiers`` but in FFN units (ints >= 1); exclusive with ``tiers``. Rank 0 must be full width.
        mode: ``"mean"`` (per-region mean; all tier 0 equals DDP), ``"sign"`` (per-region majority vote) or
            ``"demo"`` (the per-region mean sent as DCT top-k with error feedback, see ``replication``).
        tier_weights: One weight per tier (index = tier), each finite and > 0, for the per-region weighted mean or
            vote; None: every rank weighs the same.
        helper_fraction: A tier > 0 rank also trains ``floor(width * helper_fraction)`` rotating tail neurons per FFN;
            >= 0, 0 turns helpers off. Needs ``slice_weights=False`` and a mode other than ``"demo"``.
        helper_redraw_every: Optimizer steps between helper re-draws (int >= 1).
        helper_seed: Seed of the helper draws.
        slice_weights: True: a tier-``t`` rank physically holds only its FFN prefixes (real memory savings). False:
            it keeps the full weights and trains its neurons through a 0/1 mask on the FFN hidden activations
            (needed for helpers).
        replication: ``mode="demo"`` only: the DeMo exchange (``kept_fraction``: fraction of DCT coefficients kept
            per chunk, default 1/32; ``chunk``, ``values``, ``index_bits``). ``kind`` may only be ``"demo"`` and
            ``combine`` only ``"mean"``. None: the defaults in ``mode="demo"``, nothing otherwise.
        log_tier_losses: Trainer only: also log ``train/loss_tier{t}`` for every tier (mean over that tier's ranks),
            at the cost of one small all-reduce per training step (ledger label ``"metrics"``).
        auto_tiers: ``tiers="auto"`` only: the candidates, speed and memory limits, probe length and memory-limit
            overrides of the measured choice (:class:`~lightning_hetero.hetero.tier_settings.AutoTierSettings`).
            None: its defaults under ``tiers="auto"``.
        on_bad_payload: What a corrupt peer payload (NaN/Inf in an all-reduced bucket, an out-of-block DCT index)
            does: ``"raise"`` a :class:`~lightning_hetero.comm.validation.PeerPayloadError`, or ``"drop"`` it and log
            (see ``docs/reliability.md``). A different model schema always raises, at setup.
        batch_share: Trainer only: each rank's micro-batch in proportion to its speed (``docs/batch_share.md``).
            None (default): every rank takes the loader's ``batch_size``. ``"auto"``: every rank times a few
            forward and backward passes at fit start and the shares follow the measured samples per second. A list:
            one share per rank or per node (relative speeds, e.g. ``[0.75, 0.25]``). The global batch stays ``world
            size x batch_size``; each rank's contribution to a region's mean is weighted by its micro-batch (times
            its ``tier_weights`` entry), so with ``mode="mean"`` and one tier a step equals the mean gradient over
            the global batch.
        fault_tolerance: The fault-tolerant (spot worker) mode on torchft (``docs/spot.md``, "MatFormer nodes"): every
            node is its own launch of ONE rank and one replica group behind a lighthouse, holding the full model
            (``slice_weights=False``); nodes of any tier may die and rejoin while the others keep training, a joiner
            being healed from a live peer. ``tiers`` (or ``widths``) then has one entry per node, indexed by the
            node's replica-group index (``fault_tolerance.replica_rank``, else the trailing digits of its
            ``REPLICA_GROUP_ID``), so one YAML serves every node; its first entry need not be tier 0. Each step the
            gradients are averaged per region over the nodes of the quorum that trained it
            (:mod:`~lightning_hetero.matformer.ft_exchange`). Needs ``mode="mean"``, no ``tier_weights``, helpers or
            ``batch_share``, explicit tiers (not ``"auto"``). None (default): the restart-based path.
    """

    RENAMED: ClassVar[dict[str, str]] = {
        "tiers": "settings.tiers",
        "widths": "settings.widths",
        "mode": "settings.mode",
        "tier_weights": "settings.tier_weights",
        "helper_fraction": "settings.helper_fraction",
        "helper_redraw_every": "settings.helper_redraw_every",
        "helper_seed": "settings.helper_seed",
        "slice_weights": "settings.slice_weights",
        "compression": "settings.replication.kept_fraction",
        "demo_options": "settings.replication",  # its chunk, values and index_bits are fields there
        "log_tier_losses": "settings.log_tier_losses",
        "on_bad_payload": "settings.on_bad_payload",
    }
    """Adapter keywords of 0.1 -> where they are set now (an old key raises ``RenamedSettingError``)."""

    tiers: list[TierEntry] | Literal["auto"] | None = None
    widths: list[TierEntry] | None = None
    mode: AggregationMode = "mean"
    tier_weights: list[float] | None = None
    helper_fraction: float = 0.0
    helper_redraw_every: int = 16
    helper_seed: int = 0
    slice_weights: bool = True
    replication: ReplicationSettings | None = None
    log_tier_losses: bool = False
    on_bad_payload: Literal["raise", "drop"] = "raise"
    auto_tiers: AutoTierSettings | None = None
    batch_share: Literal["auto"] | tuple[float, ...] | None = None
    fault_tolerance: FaultToleranceSettings | None = None

    def __post_init__(self) -> None:
        if self.tiers is not None and self.widths is not None:
            raise ValueError(
                f"{_OWNER}.tiers={self.tiers!r} and {_OWNER}.widths={self.widths!r}: give one of them, not both "
                "(widths are tiers in FFN units)."
            )
        self._check_auto()
        given = self.tiers if self.tiers is not None and not self.auto else self.widths
        entries = None if given is None else _check_entries(self.unit, given)
        per_node = self.fault_tolerance is not None  # every node holds the full model: any node may be first
        if self.unit == "tier" and entries is not None and any(as_list(entries[0])) and not per_node:
            raise ValueError(
                f"{_OWNER}.tiers={list(entries)}: global rank 0 must be tier 0, because it holds the full model that "
                "is checkpointed and exported. Put a tier-0 rank (or node) first, e.g. tiers=[0, 1, 2]."
            )
        if entries is not None:  # a normalised copy: the caller's list cannot change the settings afterwards
            object.__setattr__(self, "tiers" if self.unit == "tier" else "widths", entries)
        check_choice(_OWNER, "mode", self.mode, get_args(AggregationMode))
        if self.tier_weights is not None:
            object.__setattr__(self, "tier_weights", _check_tier_weights(self.tier_weights, self.unit, entries))
        self._check_helpers()
        self._check_replication()
        for name in ("slice_weights", "log_tier_losses"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{_OWNER}.{name}={getattr(self, name)!r}: use true or false.")
        check_choice(_OWNER, "on_bad_payload", self.on_bad_payload, ("raise", "drop"))
        object.__setattr__(self, "batch_share", check_batch_share(_OWNER, self.batch_share))
        self._check_fault_tolerance(entries)

    # ------------------------------------------------------------------------------------------------ derived
    @property
    def auto(self) -> bool:
        """Whether the tiers are chosen from measurement at fit start (``tiers="auto"``)."""
        return isinstance(self.tiers, str) and self.tiers == "auto"

    @property
    def auto_settings(self) -> AutoTierSettings:
        """The settings of the measured choice (``auto_tiers``, or its defaults)."""
        return self.auto_tiers if self.auto_tiers is not None else AutoTierSettings()

    @property
    def unit(self) -> Literal["tier", "width"]:
        """What the entries count: ``"width"`` when ``widths`` is given, else ``"tier"``."""
        return "width" if self.widths is not None else "tier"

    @property
    def entries(self) -> list[TierEntry] | None:
        """The given ``tiers`` or ``widths`` (None: every rank tier 0, or ``tiers="auto"``: chosen at setup)."""
        given = self.tiers if self.tiers is not None and not self.auto else self.widths
        return None if given is None else [list(e) if isinstance(e, list) else e for e in given]

    @property
    def uniform_tiers(self) -> list[int] | None:
        """The distinct tiers trained, sorted, when every entry is one tier for all FFNs; None for widths or
        per-FFN entries (which name no single tier), and for ``tiers="auto"`` (known at setup only: see
        ``MatFormerRuntime.per_rank``). No ``tiers`` at all means every rank trains tier 0: ``[0]``."""
        if self.widths is not None or self.auto:
            return None
        if self.tiers is None:
            return [0]
        if any(not isinstance(entry, int) for entry in self.tiers):
            return None
        return sorted(set(self.tiers))  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------------------ checks
    def _check_auto(self) -> None:
        if isinstance(self.tiers, str) and not self.auto:
            raise ValueError(
                f"{_OWNER}.tiers={self.tiers!r}: give a list (one entry per rank or per node), 'auto' (chosen from "
                "measurement at fit start), or None."
            )
        if self.auto and self.widths is not None:
            raise ValueError(f"{_OWNER}.tiers='auto' and {_OWNER}.widths={self.widths!r}: give one of them, not both.")
        if self.auto_tiers is not None:
            keys = "candidates=..., max_slowdown=..., ..."
            check_nested(_OWNER, "auto_tiers", self.auto_tiers, AutoTierSettings, keys)
            if not self.auto:
                raise ValueError(
                    f"{_OWNER}.auto_tiers is set but tiers={self.tiers!r}: auto_tiers only applies to tiers='auto'; "
                    "set tiers: auto or remove auto_tiers."
                )
        if self.auto and self.tier_weights is not None:
            highest = max(self.auto_settings.candidates)
            if len(self.tier_weights) <= highest:
                raise ValueError(
                    f"{_OWNER}.tier_weights={list(self.tier_weights)}: tiers='auto' may choose any of the candidate "
                    f"tiers {self.auto_settings.candidates}; give one weight per tier 0..{highest}."
                )

    def _check_helpers(self) -> None:
        fraction = self.helper_fraction
        number = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
        if not (number and math.isfinite(fraction) and fraction >= 0):
            raise ValueError(f"{_OWNER}.helper_fraction={fraction!r}: use a number >= 0 (0 turns helpers off).")
        object.__setattr__(self, "helper_fraction", float(fraction))
        if fraction > 0 and self.slice_weights:
            raise ValueError(
                f"{_OWNER}.helper_fraction={fraction!r} with slice_weights=True: a helper trains tail neurons beyond "
                "its prefix, so it must keep the full weights; set slice_weights=False (or helper_fraction=0)."
            )
        if fraction > 0 and self.mode == "demo":
            raise ValueError(
                f"{_OWNER}.helper_fraction={fraction!r} with mode='demo': helpers send zeros for the tail neurons they"
                " did not draw, which DeMo would encode into its error feedback. Set helper_fraction=0, or use"
                " mode='mean' or 'sign' with helpers."
            )
        check_int(_OWNER, "helper_redraw_every", self.helper_redraw_every, minimum=1)
        if isinstance(self.helper_seed, bool) or not isinstance(self.helper_seed, int):
            raise ValueError(f"{_OWNER}.helper_seed={self.helper_seed!r}: use an int.")

    def _check_fault_tolerance(self, entries: list[TierEntry] | None) -> None:
        ft = self.fault_tolerance
        if ft is None:
            return
        keys = "lighthouse=..., min_replicas=..., ..."
        check_nested(_OWNER, "fault_tolerance", ft, FaultToleranceSettings, keys, fix=", or None; see docs/spot.md")
        where = f"{_OWNER}.fault_tolerance is set (the spot worker mode, docs/spot.md)"
        if self.auto:
            raise ValueError(
                f"{where} but tiers='auto': a node that joins mid-run cannot measure the others. Give every node's tier"
                " explicitly, one entry per replica group indexed by its REPLICA_GROUP_ID, e.g. tiers: [0, 1, 1]."
            )
        if self.slice_weights:
            raise ValueError(
                f"{where} with slice_weights=True: a node is healed from a live peer of any tier, so every node holds "
                "the full weights and trains its prefix through a mask. Set slice_weights: false."
            )
        refused = {
            "mode": (self.mode != "mean", "only the per-region mean runs over the quorum; set mode: mean"),
            "tier_weights": (self.tier_weights is not None, "the quorum's mean weighs every node alike; remove it"),
            "helper_fraction": (self.helper_fraction > 0, "helpers are not exchanged over the quorum; set it to 0"),
            "batch_share": (self.batch_share is not None, "every node is its own launch of one rank; remove it"),
        }
        for name, (bad, fix) in refused.items():
            if bad:
                raise ValueError(f"{where} with {name}={getattr(self, name)!r}: {fix}.")
        groups = ft.num_replica_groups
        if entries is not None and groups is not None and len(entries) != groups:
            name = "tiers" if self.unit == "tier" else "widths"
            raise ValueError(
                f"{_OWNER}.{name}={list(entries)} has {len(entries)} entries but fault_tolerance.num_replica_groups="
                f"{groups}: in the spot worker mode give one entry per replica group (node {groups - 1} reads entry "
                f"{groups - 1}); see docs/spot.md."
            )

    def _check_replication(self) -> None:
        replication = self.replication
        if replication is None:
            return
        keys = "kept_fraction=..., chunk=..., values=..., index_bits=..."
        check_nested(_OWNER, "replication", replication, ReplicationSettings, keys)
        if self.mode != "demo":
            raise ValueError(
                f"{_OWNER}.replication={replication!r} with mode={self.mode!r}: the replication settings only apply "
                "to mode='demo'; remove replication or set mode='demo'."
            )
        if replication.kind not in (None, "demo"):
            raise ValueError(
                f"{_OWNER}.replication.kind={replication.kind!r}: MatFormer's demo mode sends the per-region mean "
                "through the DeMo replicator only; set kind='demo' or leave it out."
            )
        if replication.combine != "mean":
            raise ValueError(
                f"{_OWNER}.replication.combine={replication.combine!r}: the per-region exchange needs the plain mean "
                "of the members' payloads (weights are applied around it); leave combine at 'mean'."
            )


# ---------------------------------------------------------------------------------------------------- entries
def as_list(entry: Any) -> list[Any]:
    """An entry as a list of per-FFN values (an int stands for the same value in every FFN)."""
    return [entry] if isinstance(entry, int) else list(entry)


def _check_entries(unit: str, entries: Any) -> list[TierEntry]:
    name, low = ("tiers", 0) if unit == "tier" else ("widths", 1)
    if isinstance(entries, (int, str)) or not isinstance(entries, Sequence) or not entries:
        raise ValueError(
            f"{_OWNER}.{name}={entries!r}: give a non-empty list, one entry per rank or per node (or None)."
        )
    out: list[TierEntry] = []
    for index, entry in enumerate(entries):
        values = [entry] if not isinstance(entry, Sequence) or isinstance(entry, str) else list(entry)
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
            raise ValueError(
                f"{_OWNER}.{name}={list(entries)}: entry {index} ({entry!r}) must be an int >= {low} or a non-empty "
                f"list of such ints (one per FFN)."
            )
        out.append(values[0] if isinstance(entry, int) else values)
    return out


def _check_tier_weights(weights: Any, unit: str, entries: Sequence[TierEntry] | None) -> list[float]:
    if isinstance(weights, (str, Mapping)) or not isinstance(weights, Sequence) or not weights:
        raise ValueError(
            f"{_OWNER}.tier_weights={weights!r}: give a list with one weight per tier (index = tier), or None."
        )
    values = []
    for tier, weight in enumerate(weights):
        number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not (number and math.isfinite(weight) and weight > 0):
            raise ValueError(f"{_OWNER}.tier_weights={list(weights)}: weight {tier} must be finite and > 0.")
        values.append(float(weight))
    if unit == "tier" and entries is not None:
        highest = max(max(as_list(entry)) for entry in entries)
        if highest >= len(values):
            raise ValueError(
                f"{_OWNER}.tier_weights={values}: {len(values)} weight(s) for tiers 0..{len(values) - 1}, but tiers "
                f"uses tier {highest}; give one weight per tier 0..{highest}."
            )
    return values


def expand_entries(owner: str, settings: MatFormerSettings, world_size: int, num_nodes: int) -> list[TierEntry]:
    """One entry per global rank: given per rank, or per node (node ``k`` holds ranks ``[kP, (k+1)P)``).

    Raises:
        ValueError: The number of entries fits neither the ranks nor the nodes of the launch.
    """
    if settings.auto:
        raise ValueError(
            f"{owner}: settings.tiers='auto' has no entries before setup measures every rank; "
            "MatFormerRuntime.resolve_world checks an auto launch instead."
        )
    entries = settings.entries
    if entries is None:
        return [0] * world_size
    if len(entries) == world_size:
        return entries
    if num_nodes >= 1 and len(entries) == num_nodes and world_size % num_nodes == 0:
        per_node = world_size // num_nodes
        return [entry for entry in entries for _ in range(per_node)]
    name = "tiers" if settings.unit == "tier" else "widths"
    raise ValueError(
        f"{owner}: settings.{name}={entries} has {len(entries)} entries, but the run has "
        f"{world_size} ranks ({num_nodes} node(s) x {world_size // max(num_nodes, 1)} devices). Give one entry "
        f"per global rank ({world_size}) or one per node ({num_nodes})."
    )


def node_entry(owner: str, settings: MatFormerSettings) -> TierEntry:
    """The fault-tolerant mode: this node's entry of ``tiers`` / ``widths`` (one per replica group), by its index.

    The index is ``fault_tolerance.replica_rank``, else the trailing digits of the node's replica id
    (``REPLICA_GROUP_ID=2`` or ``node-2``: 2). No entries: tier 0.

    Raises:
        ValueError: Not in the mode, the index cannot be resolved, or the list has no entry for it.
    """
    ft = settings.fault_tolerance
    if ft is None:
        raise ValueError(f"{owner}: node_entry needs settings.fault_tolerance (the spot worker mode).")
    entries = settings.entries
    if entries is None:
        return 0
    index = ft.resolve_replica_rank()
    if index >= len(entries):
        name = "tiers" if settings.unit == "tier" else "widths"
        raise ValueError(
            f"{owner}: this node is replica group {index} (fault_tolerance.replica_rank, or the trailing digits of "
            f"its replica id {ft.resolve_replica_id()!r}), but settings.{name}={entries} has no entry {index}. Give "
            "one entry per replica group (node i trains entry i), or start this node with a smaller "
            "REPLICA_GROUP_ID; see docs/spot.md."
        )
    return entries[index]


DEFAULT_SETTINGS = MatFormerSettings()
"""The defaults, as the adapters' default argument (frozen, so one shared instance is safe; LightningCLI lists each
field of an instance default in ``--help``)."""
