"""Every setting of the ``sparseflip`` strategies, declared and validated once.

:class:`SparseFlipSettings` is what :class:`~lightning_hetero.sparseflip.runtime.SparseFlipRuntime` and both
``SparseFlipStrategy`` adapters take. Its three groups read as nested blocks in a YAML ``init_args.settings``:
``flip`` (how the aggregated code gradient becomes the step's flips), ``exchange`` (what a rank sends of its code
gradient and where the lists meet) and ``fp_sync`` (how the fp parameters that stay unquantized are averaged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from lightning_hetero.core.settings import check_choice, check_fraction, check_int, check_positive
from lightning_hetero.sparseflip.convert import SUPPORTED_TYPES

__all__ = ["DEFAULT_SETTINGS", "CodeExchangeSettings", "FlipSettings", "FpSyncSettings", "SparseFlipSettings"]

Kind = Literal["ternary", "binary"]
Granularity = Literal["row", "layer"]
FlipRule = Literal["local_bop", "bop", "topk"]
Encoding = Literal["sign", "ternary", "bf16", "fp32"]  # comm.payload_packing.VALUE_ENCODINGS (a test keeps them equal)
Aggregation = Literal["server", "allgather"]  # sparseflip.sparse.EXCHANGE_MODES
NonfinitePolicy = Literal["raise", "skip"]
BadPayloadPolicy = Literal["raise", "drop"]  # comm.validation.BAD_PAYLOAD_POLICIES

_FLIP = "SparseFlipSettings.flip"
_EXCHANGE = "SparseFlipSettings.exchange"
_FP_SYNC = "SparseFlipSettings.fp_sync"
_SETTINGS = "SparseFlipSettings"


def _names(owner: str, name: str, value: Sequence[str] | None) -> tuple[str, ...] | None:
    """``None`` or a tuple of strings; a bare string would silently be read letter by letter, so it is refused."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{owner}.{name}={value!r}: use a list of strings, e.g. [{value!r}] for one, or null.")
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class FlipSettings:
    """How the aggregated code gradient becomes the common flips of a step (:mod:`lightning_hetero.sparseflip.rules`).

    Attributes:
        rule: ``"local_bop"`` (every rank keeps Bop's momentum of its own code gradient and sends the momenta past
            the send threshold; codes whose mean momentum passes ``bop_threshold`` move; the measured best),
            ``"bop"`` (Bop on the deciding rank over the aggregated sparse gradients) or ``"topk"`` (the seed's
            top-``k`` of the summed lists).
        max_per_step: At most this many flips per step (``k``). None: ``ceil(max_fraction * codes)``.
        max_fraction: ``k`` as a fraction of all codes when ``max_per_step`` is None. None: 0.001 for ``"topk"``,
            no cap for the Bop rules.
        bop_gamma: Bop's momentum rate in (0, 1], cosine-decayed to ``bop_decay_to`` x over the run when its length
            is known (Trainer: from ``estimated_stepping_batches``; Fabric: ``set_total_steps``).
        bop_threshold: Bop's threshold (> 0), a fraction of each layer's rms gradient.
        bop_decay_to: Final fraction of ``bop_gamma``, in [0, 1].
    """

    rule: FlipRule = "local_bop"
    max_per_step: int | None = None
    max_fraction: float | None = None
    bop_gamma: float = 0.03
    bop_threshold: float = 0.2
    bop_decay_to: float = 0.1

    def __post_init__(self) -> None:
        check_choice(_FLIP, "rule", self.rule, get_args(FlipRule))
        check_int(_FLIP, "max_per_step", self.max_per_step, minimum=1, allow_none=True, fix="or null for max_fraction")
        check_fraction(_FLIP, "max_fraction", self.max_fraction, allow_none=True)
        check_fraction(_FLIP, "bop_gamma", self.bop_gamma)
        check_positive(_FLIP, "bop_threshold", self.bop_threshold)
        value = self.bop_decay_to
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1):
            raise ValueError(f"{_FLIP}.bop_decay_to={value!r}: use a number in [0, 1] (0: gamma decays to 0).")


@dataclass(frozen=True, kw_only=True)
class CodeExchangeSettings:
    """What each rank sends of its code gradient, and where the lists meet (:mod:`lightning_hetero.sparseflip.sparse`).

    Attributes:
        send_threshold: A rank sends the entries with ``|value| > send_threshold`` (finite, >= 0). Exclusive with
            ``kept_fraction``.
        kept_fraction: A rank sends its ``ceil(kept_fraction * codes)`` largest ``|value|``, a fraction in (0, 1].
            When neither is given: ``"local_bop"`` sends the momenta past ``send_threshold_ratio *
            flip.bop_threshold``, the other rules keep 0.01.
        send_threshold_ratio: ``"local_bop"`` with neither ``send_threshold`` nor ``kept_fraction``: the send
            threshold as a multiple of ``flip.bop_threshold`` (finite, >= 0; 2.0 sends far fewer bytes).
        encoding: Values of the sent lists (the fp lists of ``fp_sync`` too): ``"sign"`` (1 bit and one fp32 scale
            per message: a vote), ``"ternary"``, ``"bf16"`` or ``"fp32"``.
        aggregation: ``"server"`` (lists go to the parameter server, which broadcasts the flips) or ``"allgather"``
            (every rank aggregates; decentralized, the same flips).
        server: Global rank of the parameter server (checked against the world size at launch).
        error_feedback: ``"bop"``/``"topk"``: each rank keeps the code gradient it did not send (or sent rounded) and
            adds it to the next step's (4 bytes per code per rank; saved in checkpoints). ``"local_bop"`` ignores
            it: there the momentum is the memory.
    """

    send_threshold: float | None = None
    kept_fraction: float | None = None
    send_threshold_ratio: float = 1.0
    encoding: Encoding = "sign"
    aggregation: Aggregation = "server"
    server: int = 0
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if self.send_threshold is not None and self.kept_fraction is not None:
            raise ValueError(
                f"{_EXCHANGE}: send_threshold={self.send_threshold!r} and kept_fraction={self.kept_fraction!r} were "
                "both given; give send_threshold (a fixed threshold) or kept_fraction (a share sent), not both."
            )
        check_positive(_EXCHANGE, "send_threshold", self.send_threshold, allow_zero=True, allow_none=True)
        check_fraction(_EXCHANGE, "kept_fraction", self.kept_fraction, allow_none=True)
        check_positive(_EXCHANGE, "send_threshold_ratio", self.send_threshold_ratio, allow_zero=True)
        check_choice(_EXCHANGE, "encoding", self.encoding, get_args(Encoding))
        check_choice(_EXCHANGE, "aggregation", self.aggregation, get_args(Aggregation))
        check_int(_EXCHANGE, "server", self.server, minimum=0, fix="a global rank")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"{_EXCHANGE}.error_feedback={self.error_feedback!r}: use true or false.")


@dataclass(frozen=True, kw_only=True)
class FpSyncSettings:
    """How the gradients of the parameters that stay fp (biases, norms, embeddings, heads, scales) are averaged.

    Attributes:
        kept_fraction: None: averaged densely, as DDP does. A fraction in (0, 1]: each rank sends only that share of
            them as a sparse list (in ``exchange.encoding``), with error feedback whose residuals are saved in
            checkpoints (:mod:`lightning_hetero.sparseflip.fp_sync`).
    """

    kept_fraction: float | None = None

    def __post_init__(self) -> None:
        check_fraction(_FP_SYNC, "kept_fraction", self.kept_fraction, allow_none=True)


@dataclass(frozen=True, kw_only=True)
class SparseFlipSettings:
    """Settings of the ``sparseflip`` strategies: low-bit weights trained by flips, exchanged as sparse lists.

    Attributes:
        kind: ``"ternary"`` ({-1, 0, +1}) or ``"binary"`` ({-1, +1}) weights.
        granularity: ``"row"`` (one fp scale per output channel) or ``"layer"``.
        trainable_scale: The fp scales are parameters, trained by your optimizer with the biases and norms.
        zero_fraction: Ternary start: this fraction, in [0, 1), of each row's smallest ``|W|`` begins at 0. None:
            plain rounding. Binary ignores it.
        skip: fnmatch patterns of module names kept in fp. None: heads, classifiers and embeddings
            (:data:`~lightning_hetero.sparseflip.convert.DEFAULT_SKIP`); ``[]``: convert every supported layer.
        include: Layer types to convert, from ``["Linear", "Conv2d", "Conv1D"]``. None: all three.
        flip: How the aggregated code gradient becomes flips (see :class:`FlipSettings`).
        exchange: What a rank sends and where the lists meet (see :class:`CodeExchangeSettings`).
        fp_sync: How the fp gradients are averaged (see :class:`FpSyncSettings`).
        drift_check_every: Every N steps, check that every rank holds bit-identical codes and weights (0: off).
        on_nonfinite: A NaN/Inf code gradient on any rank: ``"raise"`` on every rank, or ``"skip"`` (warn and apply
            no flips that step).
        on_bad_payload: A corrupt peer list (see ``docs/reliability.md``): ``"raise"`` a
            :class:`~lightning_hetero.comm.validation.PeerPayloadError` on every rank, or ``"drop"`` it (logged).
        log_comm_stats: Trainer only: log ``lowbit/*`` and ``comm/*`` per step (Fabric keeps them in
            ``last_metrics``).
    """

    RENAMED: ClassVar[dict[str, str]] = {
        "kind": "settings.kind",
        "granularity": "settings.granularity",
        "trainable_scale": "settings.trainable_scale",
        "zero_fraction": "settings.zero_fraction",
        "skip": "settings.skip",
        "include": "settings.include",
        "flip_rule": "settings.flip.rule",
        "flips_per_step": "settings.flip.max_per_step",
        "flip_fraction": "settings.flip.max_fraction",
        "bop_gamma": "settings.flip.bop_gamma",
        "bop_threshold": "settings.flip.bop_threshold",
        "bop_decay_to": "settings.flip.bop_decay_to",
        "tau": "settings.exchange.send_threshold",
        "density": "settings.exchange.kept_fraction",
        "send_fraction": "settings.exchange.send_threshold_ratio",
        "encoding": "settings.exchange.encoding",
        "aggregation": "settings.exchange.aggregation",
        "server": "settings.exchange.server",
        "fp_density": "settings.fp_sync.kept_fraction",
        "drift_check_every": "settings.drift_check_every",
        "on_nonfinite": "settings.on_nonfinite",
        "on_bad_payload": "settings.on_bad_payload",
        "log_comm_stats": "settings.log_comm_stats",
    }
    """Adapter keywords of 0.1 -> where they went (an old keyword raises ``RenamedSettingError`` naming it)."""

    kind: Kind = "ternary"
    granularity: Granularity = "row"
    trainable_scale: bool = True
    zero_fraction: float | None = 0.5
    skip: Sequence[str] | None = None
    include: Sequence[str] | None = None
    flip: FlipSettings = field(default_factory=FlipSettings)
    exchange: CodeExchangeSettings = field(default_factory=CodeExchangeSettings)
    fp_sync: FpSyncSettings = field(default_factory=FpSyncSettings)
    drift_check_every: int = 0
    on_nonfinite: NonfinitePolicy = "raise"
    on_bad_payload: BadPayloadPolicy = "raise"
    log_comm_stats: bool = True

    def __post_init__(self) -> None:
        check_choice(_SETTINGS, "kind", self.kind, get_args(Kind))
        check_choice(_SETTINGS, "granularity", self.granularity, get_args(Granularity))
        for name in ("trainable_scale", "log_comm_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{_SETTINGS}.{name}={getattr(self, name)!r}: use true or false.")
        zero = self.zero_fraction
        if zero is not None and not (isinstance(zero, (int, float)) and not isinstance(zero, bool) and 0 <= zero < 1):
            raise ValueError(f"{_SETTINGS}.zero_fraction={zero!r}: use a number in [0, 1), or null for plain rounding.")
        # Stored as tuples: the settings are frozen and hashable, and a YAML list or a Python list both work.
        object.__setattr__(self, "skip", _names(_SETTINGS, "skip", self.skip))
        object.__setattr__(self, "include", _names(_SETTINGS, "include", self.include))
        unsupported = sorted(set(self.include or ()) - set(SUPPORTED_TYPES))
        if unsupported:
            raise ValueError(
                f"{_SETTINGS}.include={list(self.include or ())!r}: {unsupported} cannot be converted; use types "
                f"from {list(SUPPORTED_TYPES)} (Conv1D is transformers.pytorch_utils.Conv1D), or null for all."
            )
        for name, group in (("flip", FlipSettings), ("exchange", CodeExchangeSettings), ("fp_sync", FpSyncSettings)):
            if not isinstance(getattr(self, name), group):
                raise ValueError(
                    f"{_SETTINGS}.{name}={getattr(self, name)!r}: use a {group.__name__}(...) (YAML: a mapping)."
                )
        check_int(_SETTINGS, "drift_check_every", self.drift_check_every, minimum=0, fix="0 turns the check off")
        check_choice(_SETTINGS, "on_nonfinite", self.on_nonfinite, get_args(NonfinitePolicy))
        check_choice(_SETTINGS, "on_bad_payload", self.on_bad_payload, get_args(BadPayloadPolicy))


DEFAULT_SETTINGS = SparseFlipSettings()
"""The defaults, as the adapters' default argument (frozen, so one shared instance is safe; LightningCLI lists each
field of an instance default in ``--help``)."""
