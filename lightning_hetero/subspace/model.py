"""The whole subspace-constrained model as one module; decoder discovery and surgery are re-exported here.

Finding the decoder, its layout and confining its layers live in :mod:`.decoder` (the stage modules build on it);
this module sits above both, so :func:`constrained_model` can use the stage module without an import cycle.
"""

from __future__ import annotations

from torch import nn

from lightning_hetero.subspace.basis import SubspaceConfig
from lightning_hetero.subspace.decoder import (
    RESIDUAL_WRITERS,
    SUPPORTED_FAMILIES,
    DecoderParts,
    constrain_layer_,
    find_decoder,
    maybe_copy,
    split_layers,
)
from lightning_hetero.subspace.export import dense_state_dict, export_dense
from lightning_hetero.subspace.stage_module import StageModule

__all__ = [
    "RESIDUAL_WRITERS",
    "SUPPORTED_FAMILIES",
    "DecoderParts",
    "constrain_layer_",
    "constrained_model",
    "dense_state_dict",
    "export_dense",
    "find_decoder",
    "maybe_copy",
]


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
    parts = find_decoder(hf_model)
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
