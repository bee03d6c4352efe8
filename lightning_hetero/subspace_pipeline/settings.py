"""``SubspacePipelineSettings``: every setting of the subspace pipeline strategy, declared and checked once.

The runtime (:class:`~lightning_hetero.subspace_pipeline.runtime.SubspacePipelineRuntime`) and both
``SubspacePipelineStrategy`` adapters (Trainer and Fabric) take one of these; in YAML it is
``init_args: {settings: {...}}``. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from lightning_hetero.core.settings import check_choice, check_int, check_positive
from lightning_hetero.pipeline.settings import PipelineSettings, check_pipeline_field
from lightning_hetero.subspace_pipeline.schedules import check_schedule

__all__ = ["DEFAULT_SETTINGS", "DEFAULT_DIM_RATIO", "SubspacePipelineSettings"]

DEFAULT_DIM_RATIO = 16.0
"""``d / k`` when neither ``subspace_dim`` nor ``dim_ratio`` is given (so ``strategy="subspace_pipeline"`` works)."""


@dataclass(frozen=True, kw_only=True)
class SubspacePipelineSettings:
    """Settings of the subspace pipeline: stages, schedule, the subspace and its updates.

    Every layer whose output crosses a stage boundary writes only into a shared ``k``-dim subspace span(U), so each
    boundary carries ``k`` coordinates per token instead of the model width ``d`` (see ``docs/subspace_pipeline.md``).

    Attributes:
        pipeline: Stages, replicas and boundary codec (see
            :class:`~lightning_hetero.pipeline.settings.PipelineSettings`).
        schedule: ``"1f1b"`` or ``"gpipe"``. Interleaved schedules are refused (one stage per rank).
        n_microbatches: Micro-batches per batch (the batch size must be a multiple); None: ``pipeline.num_stages``.
        compress: False: the plain pipeline baseline in the same code path (no subspace; boundaries carry ``d``
            numbers per token).
        subspace_dim: ``k``, the subspace dimension (coordinates per token at a boundary). Give it or
            ``dim_ratio``, not both; neither: ``dim_ratio=16``.
        dim_ratio: ``d / k``, the model width over the subspace dimension (>= 1; ``k = round(d / dim_ratio)``), for
            when ``d`` is not known in advance. Exclusive with ``subspace_dim``.
        mode: ``"reparam"`` (weights stored as ``U Z``; any optimizer) or ``"projected"`` (HF-shaped weights,
            projected gradients; pair it with ``SubspaceAdamW``).
        update_every: Optimizer steps between subspace (Grassmann) updates; 0 keeps U frozen. Needs ``compress``.
        update_lr: Step size of the subspace update (bounds the tangent of the largest rotation angle per update).
        seed: Seed of U and the frozen token table T_fixed (every rank derives the same ones, nothing is sent).
        on_bad_payload: ``"raise"``, the only choice: NaN/Inf activations or gradients from a neighbour stage (or a
            negative int8 scale) stop training with a :class:`~lightning_hetero.comm.validation.PeerPayloadError`
            (see ``docs/reliability.md``). A stage cannot compute without its input, so nothing can be dropped.
    """

    RENAMED: ClassVar[dict[str, str]] = {
        "num_stages": "settings.pipeline.num_stages",
        "data_parallel_size": "settings.pipeline.data_parallel_size",
        "coord_dtype": "settings.pipeline.boundary_dtype",
        "rank": "settings.subspace_dim",
        "compression": "settings.dim_ratio",
        "schedule": "settings.schedule",
        "n_microbatches": "settings.n_microbatches",
        "compress": "settings.compress",
        "mode": "settings.mode",
        "update_every": "settings.update_every",
        "update_lr": "settings.update_lr",
        "seed": "settings.seed",
        "on_bad_payload": "settings.on_bad_payload",
    }
    """Adapter keywords of 0.1 -> where they are now (:func:`~lightning_hetero.core.settings.reject_renamed`)."""

    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    n_microbatches: int | None = None
    compress: bool = True
    subspace_dim: int | None = None
    dim_ratio: float | None = None
    mode: Literal["reparam", "projected"] = "reparam"
    update_every: int = 0
    update_lr: float = 0.1
    seed: int = 0
    on_bad_payload: Literal["raise"] = "raise"

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_pipeline_field(owner, self.pipeline)
        # Canonical spelling ("GPipe", "1F1B" are accepted); a frozen dataclass needs object.__setattr__ for it.
        object.__setattr__(self, "schedule", check_schedule(self.schedule, owner))
        check_int(owner, "n_microbatches", self.n_microbatches, minimum=1, allow_none=True)
        if not isinstance(self.compress, bool):
            raise ValueError(f"{owner}.compress={self.compress!r}: use true or false.")
        check_int(owner, "subspace_dim", self.subspace_dim, minimum=1, allow_none=True, fix="it is k, per token")
        if self.dim_ratio is not None:
            check_positive(owner, "dim_ratio", self.dim_ratio)
            if self.dim_ratio < 1:
                raise ValueError(f"{owner}.dim_ratio={self.dim_ratio!r}: use a number >= 1 (it is d / k).")
        if self.compress and self.subspace_dim is not None and self.dim_ratio is not None:
            raise ValueError(
                f"{owner}.subspace_dim={self.subspace_dim!r} and {owner}.dim_ratio={self.dim_ratio!r}: give one of "
                "them (subspace_dim=k, or dim_ratio=d/k), not both."
            )
        check_choice(owner, "mode", self.mode, ("reparam", "projected"))
        check_int(owner, "update_every", self.update_every, minimum=0, fix="0 keeps U frozen")
        if self.update_every and not self.compress:
            raise ValueError(
                f"{owner}.update_every={self.update_every!r} with {owner}.compress=False: there is no subspace to "
                "update; use update_every=0 or compress=True."
            )
        check_positive(owner, "update_lr", self.update_lr)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"{owner}.seed={self.seed!r}: use an int.")
        if self.on_bad_payload == "drop":
            raise ValueError(
                f"{owner}.on_bad_payload='drop': a pipeline stage cannot compute a micro-batch without the activations"
                " (or gradients) its neighbour sent, so a corrupt boundary tensor cannot be dropped; use"
                " on_bad_payload='raise'."
            )
        check_choice(owner, "on_bad_payload", self.on_bad_payload, ("raise",))

    @property
    def num_microbatches(self) -> int:
        """``n_microbatches``, or ``pipeline.num_stages`` when it is None."""
        return self.pipeline.num_stages if self.n_microbatches is None else self.n_microbatches

    def resolved_dim_ratio(self) -> float | None:
        """``dim_ratio``, or :data:`DEFAULT_DIM_RATIO` when the subspace is on and neither size is given."""
        if self.compress and self.subspace_dim is None and self.dim_ratio is None:
            return DEFAULT_DIM_RATIO
        return self.dim_ratio

    def check_model_types(self, model_types: Collection[str]) -> None:
        """Raise ``ValueError`` unless one of the HF ``model_types`` (``config.model_type`` of the models a module
        holds or will build) is a family this pipeline can split: checked by the launching process, before any
        worker starts. None known (a model built later, or not from HF) passes: the workers check the built model.
        """
        from lightning_hetero.hf.decoder import SUPPORTED_FAMILIES  # torch only when a launcher checks a model

        families = list(SUPPORTED_FAMILIES.values())
        if not model_types or any(kind in families for kind in model_types):
            return
        raise ValueError(
            f"subspace_pipeline cannot split a {'/'.join(sorted(model_types))!r} model: it takes the Llama family "
            f"({', '.join(families)}: pre-norm decoders whose residual writers are o_proj and down_proj). Use such a "
            "model (e.g. preset llama-tiny), or another strategy (flexdemo takes any model; matformer and layerwise "
            "take GPT-2 too)."
        )


DEFAULT_SETTINGS = SubspacePipelineSettings()
"""The defaults, as the adapters' default argument (frozen, so one shared instance is safe; LightningCLI lists each
field of an instance default in ``--help``)."""
