"""Typed settings of the FlexDeMo strategies (Trainer and Fabric), declared and documented once.

``FlexDeMoStrategy(settings=FlexDeMoSettings(shard_size=2, replication=ReplicationSettings(kind="demo")))`` in
Python; in YAML ``strategy: {class_path: FlexDeMoStrategy, init_args: {settings: {shard_size: 2, replication:
{kind: demo}}}}``. Every field is checked when the object is built, so a bad value fails before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from lightning_hetero.core.settings import check_choice, check_int
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.hetero.batch_share import check_batch_share
from lightning_hetero.replication.settings import ReplicationSettings

__all__ = ["DEFAULT_SETTINGS", "FlexDeMoSettings"]

_OWNER = "FlexDeMoSettings"


@dataclass(frozen=True, kw_only=True)
class FlexDeMoSettings:
    """FlexDeMo: FSDP2 inside a node, compressed decoupled-momentum replication between nodes.

    Attributes:
        replication: How updates cross nodes (see :class:`~lightning_hetero.replication.ReplicationSettings`):
            ``kind`` (``"demo"``, ``"random"``, ``"striding"``, ``"topk"``, ``"diloco"``, ``"full"``; default None:
            ``"demo"`` with two or more model copies, ``"full"`` with one, where nothing crosses nodes and
            compression would only lose information; any replication field set keeps the exchange, with a warning
            on one copy), ``kept_fraction``, ``values``, ``chunk``, ``index_bits``, ``combine``, ``seed`` and
            DiLoCo's ``sync_every``, ``outer_lr``, ``outer_momentum``, ``outer_kept_fraction``, ``outer_chunk``.
            Used for converted optimizers (a ``DeMoSGD``/``DecoupledAdamW`` given ready-built keeps its own).
        shard_size: Ranks that shard one model copy (consecutive ranks); None: all ranks of a node. Must divide the
            ranks per node (checked before the processes start). 1 gives DDP-like copies on every rank, each
            replicating over the others.
        drift_check_every: Every N optimizer steps, check that the model copies are bit-identical (0: off); a
            mismatch raises naming the step, the ranks and the first differing parameter. DiLoCo: at the next
            synchronising step.
        overlap: Start each block's inter-node exchange during backward, as soon as its gradients are reduced.
            The Trainer turns it off by itself when it clips gradients (clipping needs the whole node's norm
            first); with Fabric set it False to use ``fabric.clip_gradients``.
        activation_checkpointing: Recompute each block's activations in backward (less memory, ~1/3 more compute).
        block_classes: Class names of the blocks to shard individually, e.g. ``["LlamaDecoderLayer"]``; None: found
            from the model (``_no_split_modules`` of HF models, else a ``ModuleList`` of identical layers).
        on_bad_payload: What a corrupt peer payload does (see ``docs/reliability.md``): ``"raise"`` a
            :class:`~lightning_hetero.comm.validation.PeerPayloadError`, or ``"drop"`` it from the combination and
            log.
        log_comm_stats: Trainer only: log ``comm/hidden_fraction``, ``comm/inter/bytes_sent_step`` (left to a
            ``CommunicationMonitor`` when one logs it), ``comm/wait_seconds``, ... every step (Fabric: read
            ``strategy.last_comm_metrics``); see docs/metrics.md.
        adamw_exchange: What crosses nodes when the module's AdamW/Adam is converted to ``DecoupledAdamW`` with a
            compressing replicator (Full and DiLoCo replication ignore it): ``"preconditioned"`` (default) exchanges
            the gradient divided by the local ``sqrt(v_hat) + eps`` and lets the error-feedback buffer be the first
            moment (DeMo's decoupled momentum; Adam's ``beta1`` is not used); ``"direction"`` (0.1's behaviour) runs
            Adam locally and exchanges its update direction ``m_hat / (sqrt(v_hat) + eps)`` (error feedback on the
            direction; needed to resume a 0.1 checkpoint); ``"gradient"`` exchanges the raw gradient (error feedback
            on it) and runs Adam on the combined gradient, so the moments are identical on every node and, when the
            replicator keeps everything, the step is exactly ``torch.optim.AdamW`` on the nodes' mean gradient.
            Measured over 2,000 steps in ``docs/flexdemo.md`` ("Over a real horizon").
        preconditioner_beta2: Under ``adamw_exchange="preconditioned"`` with a compressing replicator, the decay of
            the local second moment that divides what is exchanged: it replaces the converted AdamW's ``beta2``
            (``beta1`` is unused there anyway). Default 0.999: the error-feedback buffer sums the preconditioned
            gradient over many steps, and a short second-moment window (LLM recipes' 0.95) measured 3% worse in
            final loss (``docs/flexdemo.md``). None keeps the optimizer's own ``beta2``. Full and DiLoCo replication,
            ``"direction"`` and ``"gradient"`` keep it always.
        fault_tolerance: Opt-in spot-worker mode (see ``docs/spot.md``): the model copies are torchft replica
            groups that may leave and rejoin mid-run while the others keep training
            (:class:`~lightning_hetero.ft.FaultToleranceSettings`: lighthouse, ``min_replicas``, timeouts, replica
            id). Each replica group is its own launch of one node (``num_nodes=1``, FSDP2 over its ranks). None
            (default): the restart-based path, unchanged.
        batch_share: Trainer only: each rank's micro-batch in proportion to its speed (``docs/batch_share.md``).
            None (default): every rank takes the loader's ``batch_size``. ``"auto"``: every rank times a few
            forward and backward passes at fit start and the shares follow the measured samples per second. A list:
            one share per rank or per node (relative speeds, e.g. ``[0.75, 0.25]``). The global batch stays ``world
            size x batch_size`` (``batch_size`` is the mean micro-batch); the ranks of one model copy get one size;
            each local gradient is scaled by ``world size x its samples / global batch`` before it enters the
            momentum, so with ``replication.kind="full"`` a step equals the mean gradient over the global batch.
            Not with ``fault_tolerance``.
    """

    RENAMED: ClassVar[dict[str, str]] = {
        "replicator": "settings.replication.kind",
        "compression": "settings.replication.kept_fraction",
        "replicator_options": "settings.replication",  # same keys, but outer_compression is outer_kept_fraction
        "shard_size": "settings.shard_size",
        "drift_check_every": "settings.drift_check_every",
        "overlap": "settings.overlap",
        "activation_checkpointing": "settings.activation_checkpointing",
        "block_classes": "settings.block_classes",
        "on_bad_payload": "settings.on_bad_payload",
        "log_comm_stats": "settings.log_comm_stats",
    }
    """Old adapter keywords (0.1) -> where they went."""

    replication: ReplicationSettings = field(default_factory=ReplicationSettings)
    shard_size: int | None = None
    drift_check_every: int = 0
    overlap: bool = True
    activation_checkpointing: bool = False
    block_classes: tuple[str, ...] | None = None
    on_bad_payload: Literal["raise", "drop"] = "raise"
    log_comm_stats: bool = True
    adamw_exchange: Literal["direction", "preconditioned", "gradient"] = "preconditioned"
    preconditioner_beta2: float | None = 0.999
    fault_tolerance: FaultToleranceSettings | None = None
    batch_share: Literal["auto"] | tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.replication, ReplicationSettings):
            raise ValueError(
                f"{_OWNER}.replication={self.replication!r}: use a ReplicationSettings(...) (YAML: a mapping such as"
                " {kind: demo, kept_fraction: 0.03125})."
            )
        check_int(_OWNER, "shard_size", self.shard_size, minimum=1, allow_none=True, fix="None: all ranks of a node")
        check_int(_OWNER, "drift_check_every", self.drift_check_every, minimum=0, fix="0 turns the check off")
        for name in ("overlap", "activation_checkpointing", "log_comm_stats"):
            _check_bool(name, getattr(self, name))
        classes: Any = self.block_classes
        if classes is not None:
            if isinstance(classes, str) or not isinstance(classes, (list, tuple)):
                raise ValueError(
                    f"{_OWNER}.block_classes={classes!r}: give a list of class names, e.g. ['LlamaDecoderLayer']."
                )
            if not classes or not all(isinstance(name, str) and name for name in classes):
                raise ValueError(
                    f"{_OWNER}.block_classes={classes!r}: give a non-empty list of class names, e.g."
                    " ['LlamaDecoderLayer'], or None to find the blocks from the model."
                )
            object.__setattr__(self, "block_classes", tuple(classes))  # a list from Python is accepted; frozen: tuple
        check_choice(_OWNER, "on_bad_payload", self.on_bad_payload, ("raise", "drop"))
        check_choice(_OWNER, "adamw_exchange", self.adamw_exchange, ("direction", "preconditioned", "gradient"))
        beta2 = self.preconditioner_beta2
        if beta2 is not None and (isinstance(beta2, bool) or not isinstance(beta2, (int, float)) or not 0 <= beta2 < 1):
            raise ValueError(
                f"{_OWNER}.preconditioner_beta2={beta2!r}: use a number in [0, 1) such as 0.999, or None to keep the"
                " optimizer's own beta2."
            )
        if self.fault_tolerance is not None and not isinstance(self.fault_tolerance, FaultToleranceSettings):
            raise ValueError(
                f"{_OWNER}.fault_tolerance={self.fault_tolerance!r}: use a FaultToleranceSettings(...) (YAML: a mapping"
                " such as {lighthouse: 'http://head:29510', min_replicas: 2}), or None for the restart-based path."
            )
        object.__setattr__(self, "batch_share", check_batch_share(_OWNER, self.batch_share))
        if self.batch_share is not None and self.fault_tolerance is not None:
            raise ValueError(
                f"{_OWNER}.batch_share={self.batch_share!r} with fault_tolerance: replica groups come and go, so no"
                " rank knows the others' micro-batches; set batch_share=None or drop fault_tolerance."
            )


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{_OWNER}.{name}={value!r}: use True or False.")


DEFAULT_SETTINGS = FlexDeMoSettings()
"""All defaults: the adapters' default ``settings``."""
