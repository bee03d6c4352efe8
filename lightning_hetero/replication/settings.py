"""Typed settings of a replicator: which one, how much it keeps, how it encodes, and DiLoCo's outer step.

:class:`ReplicationSettings` replaces the ``replicator`` / ``compression`` / ``replicator_options`` triple of 0.1.
It validates every field when it is built (a field that does not apply to the chosen kind is an error naming it),
and :meth:`ReplicationSettings.build` makes a fresh :class:`~lightning_hetero.replication.base.Replicator` from it.
FlexDeMo (``FlexDeMoSettings.replication``) and MatFormer's ``demo`` aggregation both take one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from lightning_hetero.comm.payload_packing import INDEX_BITS, VALUE_ENCODINGS
from lightning_hetero.core.settings import check_choice, check_fraction, check_int, check_positive
from lightning_hetero.replication.base import Replicator
from lightning_hetero.replication.dense import FullReplicator, RandomReplicator, StridingReplicator
from lightning_hetero.replication.diloco import DiLoCoReplicator
from lightning_hetero.replication.sparse import _MAX_CHUNK, COMBINE_MODES, DeMoReplicator, TopKReplicator

__all__ = [
    "DEFAULT_KEPT_FRACTION",
    "DEFAULT_SYNC_EVERY",
    "REPLICATORS",
    "ReplicationSettings",
    "ReplicatorKind",
    "ValueEncoding",
]

ReplicatorKind = Literal["demo", "random", "striding", "diloco", "full", "topk"]
ValueEncoding = Literal["fp32", "bf16", "sign", "ternary"]

DEFAULT_KEPT_FRACTION = 1 / 32
"""The fraction of coefficients kept when none is given."""
DEFAULT_SYNC_EVERY = 32
"""DiLoCo's local steps between synchronisations when none is given (the bytes per step of a 1/32 kept fraction)."""

_OWNER = "ReplicationSettings"
REPLICATORS: dict[str, type[Replicator]] = {
    "demo": DeMoReplicator,
    "random": RandomReplicator,
    "striding": StridingReplicator,
    "diloco": DiLoCoReplicator,
    "full": FullReplicator,
    "topk": TopKReplicator,
}
"""Each replicator kind's class (``ReplicationSettings.build`` and ``build_replicator`` look kinds up here)."""
# Which kinds each kind-specific field applies to (a field at its default is never an error).
_APPLIES_TO: dict[str, tuple[str, ...]] = {
    "kept_fraction": ("demo", "random", "striding", "topk"),
    "chunk": ("demo", "topk"),
    "index_bits": ("demo", "topk"),
    "combine": ("demo", "topk"),
    "seed": ("random",),
    "sync_every": ("diloco",),
    "outer_lr": ("diloco",),
    "outer_momentum": ("diloco",),
    "outer_kept_fraction": ("diloco",),
    "outer_chunk": ("diloco",),
}


@dataclass(frozen=True, kw_only=True)
class ReplicationSettings:
    """How the local update of each model copy is exchanged between copies (over the replicate group).

    Attributes:
        kind: The replicator: ``"demo"`` (top-k of the chunked DCT, indices and values sent), ``"random"``
            (shared-seed random coordinates, values only), ``"striding"`` (every P-th coordinate, rotating),
            ``"topk"`` (top-k per chunk without the DCT), ``"diloco"`` (local steps, then an outer Nesterov step on
            the averaged parameter delta every ``sync_every`` steps) or ``"full"`` (dense mean: the full-sync
            baseline). None (FlexDeMo's default): ``"demo"`` when the run has two or more model copies, ``"full"``
            with one (nothing crosses nodes, so compression would only lose information) unless some other field
            is set.
        kept_fraction: Fraction of each parameter's coefficients sent per step, in (0, 1], e.g. 1/32 = 0.03125
            (demo, random, striding, topk).
        values: Encoding of the sent values: ``"fp32"``, ``"bf16"``, ``"sign"`` (1 bit + one scale per row) or
            ``"ternary"`` (2 bits + one scale per row). Every kind.
        chunk: Side of the DCT block (demo) or chunk length (topk); at most 256.
        index_bits: Bits per sent index, 12 or 16; None: 12 when ``chunk * chunk <= 4096``, else 16 (demo, topk).
        combine: How the replicas' sparse payloads are combined: ``"mean"`` (sum / replicas) or ``"pickers"`` (each
            coordinate divided by the number of replicas that sent it) (demo, topk).
        seed: Shared seed of the coordinate draw (random).
        sync_every: DiLoCo's ``H``: local optimizer steps between synchronisations; None: 32 (diloco).
        outer_lr: DiLoCo's outer learning rate, > 0 (DiLoCo paper: 0.7).
        outer_momentum: DiLoCo's outer Nesterov momentum, in [0, 1) (DiLoCo paper: 0.9).
        outer_kept_fraction: DeMo + DiLoCo: send only this fraction of the delta's chunked-DCT coefficients (top-k
            with error feedback) at each synchronisation, in (0, 1]; None: the whole delta (diloco).
        outer_chunk: DCT block side of the compressed delta (diloco with ``outer_kept_fraction``).
    """

    RENAMED: ClassVar[dict[str, str]] = {
        "replicator": "kind",
        "compression": "kept_fraction",
        "outer_compression": "outer_kept_fraction",
    }
    """Old ``replicator_options`` / adapter keys -> the field that replaced them (relative to this class)."""

    kind: ReplicatorKind | None = None
    kept_fraction: float = DEFAULT_KEPT_FRACTION
    values: ValueEncoding = "fp32"
    chunk: int = 64
    index_bits: Literal[12, 16] | None = None
    combine: Literal["mean", "pickers"] = "mean"
    seed: int = 0
    sync_every: int | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_kept_fraction: float | None = None
    outer_chunk: int = 64

    def __post_init__(self) -> None:
        check_choice(_OWNER, "kind", self.kind, [None, *get_args(ReplicatorKind)])
        check_fraction(_OWNER, "kept_fraction", self.kept_fraction)
        check_choice(_OWNER, "values", self.values, VALUE_ENCODINGS)
        check_int(_OWNER, "chunk", self.chunk, minimum=1)
        if self.chunk > _MAX_CHUNK:
            raise ValueError(
                f"{_OWNER}.chunk={self.chunk!r}: use an int in [1, {_MAX_CHUNK}] (chunk * chunk coefficients per block"
                " must be addressable by 16-bit indices)."
            )
        if self.index_bits is not None:
            check_choice(_OWNER, "index_bits", self.index_bits, INDEX_BITS)
            if self.chunk * self.chunk > 1 << self.index_bits:
                raise ValueError(
                    f"{_OWNER}.index_bits={self.index_bits!r}: cannot address chunk={self.chunk} ({self.chunk**2}"
                    f" coefficients per block); use index_bits=16, chunk <= {int((1 << self.index_bits) ** 0.5)},"
                    " or None (chosen from chunk)."
                )
        check_choice(_OWNER, "combine", self.combine, COMBINE_MODES)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"{_OWNER}.seed={self.seed!r}: use an int.")
        check_int(_OWNER, "sync_every", self.sync_every, minimum=1, allow_none=True, fix="None means 32")
        check_positive(_OWNER, "outer_lr", self.outer_lr)
        number = isinstance(self.outer_momentum, (int, float)) and not isinstance(self.outer_momentum, bool)
        if not (number and 0 <= self.outer_momentum < 1):
            raise ValueError(f"{_OWNER}.outer_momentum={self.outer_momentum!r}: use a number in [0, 1), e.g. 0.9.")
        check_fraction(_OWNER, "outer_kept_fraction", self.outer_kept_fraction, allow_none=True)
        check_int(_OWNER, "outer_chunk", self.outer_chunk, minimum=1)
        if self.outer_chunk > _MAX_CHUNK:
            raise ValueError(f"{_OWNER}.outer_chunk={self.outer_chunk!r}: use an int in [1, {_MAX_CHUNK}].")
        self._check_applies()

    def _check_applies(self) -> None:
        """A field set away from its default must apply to the kind (None counts as demo: its default choice)."""
        kind = self.kind or "demo"
        defaults = ReplicationSettings.__dataclass_fields__
        for name, kinds in _APPLIES_TO.items():
            if kind in kinds or getattr(self, name) == defaults[name].default:
                continue
            shown = f"kind={self.kind!r}" if self.kind is not None else "kind=None (demo or full)"
            raise ValueError(
                f"{_OWNER}.{name}={getattr(self, name)!r}: applies only to kind in {list(kinds)}, not {shown}; "
                f"remove it, or set kind to one of {list(kinds)}."
            )
        if self.outer_chunk != defaults["outer_chunk"].default and self.outer_kept_fraction is None:
            raise ValueError(
                f"{_OWNER}.outer_chunk={self.outer_chunk!r}: applies only with outer_kept_fraction (DeMo + DiLoCo); "
                "set outer_kept_fraction too, or remove outer_chunk."
            )

    @property
    def explicit(self) -> bool:
        """Whether any field differs from its default (FlexDeMo then keeps the exchange even with one model copy)."""
        return self != ReplicationSettings()

    @property
    def resolved_sync_every(self) -> int:
        """DiLoCo's synchronisation period (``sync_every``, or 32 when None)."""
        return DEFAULT_SYNC_EVERY if self.sync_every is None else self.sync_every

    def build(self, default_kind: ReplicatorKind = "demo") -> Replicator:
        """A fresh replicator from these settings (one per optimizer: replicators hold per-run state).

        Args:
            default_kind: The kind built when :attr:`kind` is None (FlexDeMo passes ``"full"`` for one model copy).
        """
        kind = self.kind or default_kind
        check_choice(_OWNER, "kind", kind, get_args(ReplicatorKind))
        if kind == "full":
            return FullReplicator(values=self.values)
        if kind == "diloco":
            sync_every = self.resolved_sync_every
            return DiLoCoReplicator(
                1 / sync_every,  # only describe() reads it: the bytes per step relative to a dense exchange
                sync_every=sync_every,
                outer_lr=self.outer_lr,
                outer_momentum=self.outer_momentum,
                values=self.values,
                outer_kept_fraction=self.outer_kept_fraction,
                outer_chunk=self.outer_chunk,
            )
        if kind in ("random", "striding"):
            return REPLICATORS[kind](self.kept_fraction, values=self.values, seed=self.seed)
        return REPLICATORS[kind](
            self.kept_fraction, chunk=self.chunk, values=self.values, index_bits=self.index_bits, combine=self.combine
        )
