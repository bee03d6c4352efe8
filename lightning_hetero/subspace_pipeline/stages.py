"""Building the pipeline's stage modules (or the whole constrained model) from a supported HF decoder, the loss, and
the single-process reference.

One stage is a :class:`~lightning_hetero.subspace_pipeline.stage_module.StageModule`; the decoder is found by
:func:`lightning_hetero.hf.decoder.find_decoder` and its layers split by
:func:`lightning_hetero.pipeline.layout.split_layers`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hetero.hf.decoder import find_decoder
from lightning_hetero.pipeline.layout import split_layers
from lightning_hetero.subspace_pipeline.basis import SubspaceConfig
from lightning_hetero.subspace_pipeline.layers import CONFINED_WRITER_TYPES
from lightning_hetero.subspace_pipeline.stage_module import StageModule

__all__ = ["build_stages", "causal_lm_loss", "constrained_model", "reference_forward"]


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Shifted next-token cross-entropy, mean over tokens whose label is not -100 (HF's convention)."""
    shifted_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1]).float()
    shifted_labels = labels[:, 1:].reshape(-1).to(shifted_logits.device)
    return F.cross_entropy(shifted_logits, shifted_labels, ignore_index=-100)


def build_stages(
    hf_model: nn.Module,
    config: SubspaceConfig,
    num_stages: int,
    stage_indices: Sequence[int],
    *,
    copy: bool = False,
    release_unused: bool = False,
) -> list[StageModule]:
    """Build the stage modules ``stage_indices`` of a ``num_stages``-deep pipeline over a supported HF decoder.

    Layers are split by :func:`split_layers`; ``o_proj``/``down_proj`` of every layer outside the last stage are
    confined (also in the stages built here that precede it), the embedding is confined and gets ``T_fixed``, tied
    embeddings are untied. Every rank building from the same seeded HF weights gets bit-identical stages.

    Args:
        hf_model: A supported HF causal LM or any module holding one (e.g. the user's LightningModule).
        config: The :class:`SubspaceConfig`.
        num_stages: Pipeline depth.
        stage_indices: Which stages to build (a rank's own; several for interleaved schedules).
        copy: Deep-copy the HF modules used (leaves ``hf_model`` unchanged); by default they are reused and confined
            in place.
        release_unused: Replace every parameter and buffer of ``hf_model`` not used by the built stages with a meta
            tensor, freeing its memory (the module tree stays, unusable). Only without ``copy``.

    Raises:
        ValueError: unsupported model family, bad ``num_stages``/``stage_indices``/``subspace_dim``/``dim_ratio``.
    """
    parts = find_decoder(hf_model, CONFINED_WRITER_TYPES)
    config.resolve_subspace_dim(parts.hidden_size)  # validate k against d before touching anything
    ranges = split_layers(parts.num_layers, num_stages)
    indices = list(stage_indices)
    if not indices or len(set(indices)) != len(indices) or any(not 0 <= i < num_stages for i in indices):
        raise ValueError(f"stage_indices={indices!r} must be distinct integers in [0, {num_stages}).")
    constrained = set(range(0, ranges[-1][0]))
    stages = [
        StageModule.build(
            parts,
            config,
            layer_range=ranges[i],
            constrained_layers=constrained,
            stage_index=i,
            num_stages=num_stages,
            is_first=i == 0,
            is_last=i == num_stages - 1,
            copy=copy,
        )
        for i in indices
    ]
    if release_unused and not copy:
        _release_unused(hf_model, stages)
    return stages


def constrained_model(
    hf_model: nn.Module, config: SubspaceConfig, num_stages: int, *, copy: bool = False
) -> StageModule:
    """The whole constrained model as ONE module (no boundary encode/decode inside): ``model(None, input_ids)``.

    It equals the chain of ``build_stages(hf_model, config, num_stages, all stages)``: the same layers are confined
    (those of every stage but the last), the same U, T_fixed and weights; only the boundaries' encode/decode is
    absent, so comparing the two checks that reconstruction is exact.

    Args:
        hf_model: A supported HF causal LM, or any module holding one.
        config: The subspace configuration.
        num_stages: The pipeline depth the model is built for: it decides which layers are free (the last stage's).
        copy: Deep-copy the needed HF modules first (leaves ``hf_model`` untouched); by default they are reused and
            transformed in place.
    """
    parts = find_decoder(hf_model, CONFINED_WRITER_TYPES)
    ranges = split_layers(parts.num_layers, num_stages)
    constrained = set(range(0, ranges[-1][0]))
    return StageModule.build(
        parts,
        config,
        layer_range=(0, parts.num_layers),
        constrained_layers=constrained,
        stage_index=0,
        num_stages=1,
        is_first=True,
        is_last=True,
        boundary_layers=[start for start, _ in ranges[1:]],
        copy=copy,
    )


def _release_unused(hf_model: nn.Module, stages: list[StageModule]) -> None:
    keep = {id(t) for stage in stages for t in (*stage.parameters(), *stage.buffers())}
    for module in hf_model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is not None and id(parameter) not in keep:
                module._parameters[name] = nn.Parameter(
                    torch.empty_like(parameter, device="meta"), requires_grad=parameter.requires_grad
                )
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and id(buffer) not in keep:
                module._buffers[name] = torch.empty_like(buffer, device="meta")


def reference_forward(
    model: StageModule | Sequence[StageModule], input_ids: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """Logits of the constrained model run in one process: either the whole-model module from
    :func:`~lightning_hetero.subspace_pipeline.constrained_model`, or the full list of stages chained (boundary codec
    included)."""
    if isinstance(model, StageModule):
        return model(None, input_ids, attention_mask)
    stages = sorted(model, key=lambda stage: stage.stage_index)
    if [s.stage_index for s in stages] != list(range(stages[0].num_stages)):
        raise ValueError("reference_forward needs every stage of the pipeline, 0..num_stages-1.")
    hidden: Tensor | None = None
    for stage in stages:
        hidden = stage(hidden, input_ids, attention_mask)
    return hidden
