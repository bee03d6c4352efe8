"""``LayerwiseSettings``: every setting of decoupled greedy layerwise training (``strategy="layerwise"``), once.

The runtime (:class:`~lightning_hetero.layerwise.dgl_runtime.DecoupledRuntime`) and both ``LayerwiseStrategy``
adapters (Trainer and Fabric) take one of these; in YAML it is ``init_args: {settings: {...}}``. Nothing here
imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from lightning_hetero.core.settings import check_choice, check_int
from lightning_hetero.pipeline.settings import PipelineSettings, check_pipeline_field

__all__ = ["DEFAULT_SETTINGS", "AUX_HEADS", "LayerwiseSettings"]

AUX_HEADS: tuple[str, ...] = ("linear", "mlp", "lm_head")
"""Kinds of auxiliary head (:data:`lightning_hetero.layerwise.stack.AUX_HEAD_KINDS`)."""


@dataclass(frozen=True, kw_only=True)
class LayerwiseSettings:
    """Settings of decoupled greedy layerwise training: one block per stage, local losses, activations sent forward.

    Attributes:
        pipeline: Stages, replicas and the codec of the activations on the wire (see
            :class:`~lightning_hetero.pipeline.settings.PipelineSettings`).
        boundaries: Unit indices (layers / conv stages) at which stages 1.. start, ``pipeline.num_stages - 1`` of
            them (e.g. ``[1]``: one unit on stage 0, the rest on stage 1); None: a balanced split.
        aux_head: Local head of the stages before the last: ``"linear"``, ``"mlp"`` or ``"lm_head"`` (causal LMs:
            final norm + projection initialised from the LM head).
        aux_outputs: Outputs of the auxiliary heads (must equal the model's classes / vocabulary); None: the
            model's.
        mode: ``"sync"`` (stage s+1 trains on the activations of the same step) or ``"async"`` (on the newest ones
            received, from a bounded replay buffer: a stage never waits while it holds activations less than
            ``replay_capacity`` steps old).
        replay_capacity: Entries of the replay buffer (``mode="async"``); also how many batches a stage keeps.
        max_in_flight: Sends a stage may have outstanding before it waits for the link (how far it runs ahead).
        on_bad_payload: What corrupt activations from the previous stage do (see ``docs/reliability.md``):
            ``"raise"`` a :class:`~lightning_hetero.comm.validation.PeerPayloadError`, or ``"drop"``
            (``mode="async"`` only): the message is left out (logged, counted) and the stage trains on the newest
            usable activations in its replay buffer; with none usable it raises.
        export_dir: Trainer only. Write the trained model there when fit ends (HF ``save_pretrained``; a CNN:
            ``model.pt``), as :class:`~lightning_hetero.strategies.layerwise.callbacks.GreedyLayerwise` does;
            auxiliary heads are not part of it. None: no export (``strategy.export(path)`` does it on demand, also
            under Fabric).
    """

    RENAMED: ClassVar[dict[str, str]] = {
        "num_stages": "settings.pipeline.num_stages",
        "data_parallel_size": "settings.pipeline.data_parallel_size",
        "activation_dtype": "settings.pipeline.boundary_dtype",
        "boundaries": "settings.boundaries",
        "aux_head": "settings.aux_head",
        "aux_outputs": "settings.aux_outputs",
        "mode": "settings.mode",
        "replay_capacity": "settings.replay_capacity",
        "max_in_flight": "settings.max_in_flight",
        "on_bad_payload": "settings.on_bad_payload",
        "export_dir": "settings.export_dir",
    }
    """Adapter keywords of 0.1 -> where they are now (:func:`~lightning_hetero.core.settings.reject_renamed`)."""

    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    boundaries: tuple[int, ...] | None = None
    aux_head: Literal["linear", "mlp", "lm_head"] = "linear"
    aux_outputs: int | None = None
    mode: Literal["sync", "async"] = "sync"
    replay_capacity: int = 4
    max_in_flight: int = 2
    on_bad_payload: Literal["raise", "drop"] = "raise"
    export_dir: str | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_pipeline_field(owner, self.pipeline)
        if self.boundaries is not None:
            self._check_boundaries(owner)
        check_choice(owner, "aux_head", self.aux_head, AUX_HEADS)
        check_int(owner, "aux_outputs", self.aux_outputs, minimum=1, allow_none=True)
        check_choice(owner, "mode", self.mode, ("sync", "async"))
        check_int(owner, "replay_capacity", self.replay_capacity, minimum=1, fix="the number of buffered steps")
        check_int(owner, "max_in_flight", self.max_in_flight, minimum=1)
        check_choice(owner, "on_bad_payload", self.on_bad_payload, ("raise", "drop"))
        if self.on_bad_payload == "drop" and self.mode != "async":
            raise ValueError(
                f"{owner}.on_bad_payload='drop' with {owner}.mode={self.mode!r}: a synchronous stage needs the "
                "activations of its own step, so there is nothing to replace dropped ones with; use mode='async' "
                "(older activations are replayed) or on_bad_payload='raise'."
            )
        if self.export_dir is not None:
            if not isinstance(self.export_dir, str) or not self.export_dir:
                raise ValueError(f"{owner}.export_dir={self.export_dir!r}: use a directory path, or None.")

    def _check_boundaries(self, owner: str) -> None:
        boundaries = self.boundaries
        if isinstance(boundaries, (str, bytes)) or not hasattr(boundaries, "__iter__"):
            raise ValueError(f"{owner}.boundaries={boundaries!r}: use a list of unit indices, or None.")
        values = tuple(boundaries)  # type: ignore[arg-type]
        if any(isinstance(b, bool) or not isinstance(b, int) for b in values) or list(values) != sorted(set(values)):
            raise ValueError(
                f"{owner}.boundaries={list(values)!r}: use strictly increasing ints >= 1 (the first unit index of "
                "stages 1..), or None for a balanced split."
            )
        if values and values[0] < 1:
            raise ValueError(f"{owner}.boundaries={list(values)!r}: use ints >= 1 (stage 0 needs at least one unit).")
        stages = self.pipeline.num_stages
        if len(values) != stages - 1:
            raise ValueError(
                f"{owner}.boundaries={list(values)!r} with pipeline.num_stages={stages}: give num_stages - 1 = "
                f"{stages - 1} boundaries (the first unit index of stages 1..{stages - 1}), or none."
            )
        # A YAML or Python list becomes a tuple: the settings are frozen, so no field may be mutable.
        object.__setattr__(self, "boundaries", values)


DEFAULT_SETTINGS = LayerwiseSettings()
"""The defaults, as the adapters' default argument (frozen, so one shared instance is safe; LightningCLI lists each
field of an instance default in ``--help``)."""
