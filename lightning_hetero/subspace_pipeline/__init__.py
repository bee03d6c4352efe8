"""Subspace networks ("Protocol Models"): HF decoders whose stage boundaries carry k numbers per token, losslessly.

Framework-free core (no Lightning imports): the shared basis and Grassmann update (:mod:`.basis`), the confined
layers and the surgery that puts them in a decoder (:mod:`.layers`), stage modules and the whole constrained model
(:mod:`.stage_module`, :mod:`.stages`), the subspace-preserving optimizer (:mod:`.optim`) and dense export
(:mod:`.export`). Decoder discovery (:mod:`lightning_hetero.hf.decoder`), the rank layout, boundary codec and export
gather (:mod:`lightning_hetero.pipeline`) are the shared floor below. The pipeline runtime and the Lightning/Fabric
strategies build on these. See ``docs/subspace_pipeline.md``.
"""

from lightning_hetero.subspace_pipeline.basis import (
    COORD_DTYPES,
    FixedTokenTable,
    SubspaceBasis,
    SubspaceConfig,
    orthonormal_basis,
    outside_span_fraction,
    propose_basis,
)
from lightning_hetero.subspace_pipeline.export import dense_state_dict, export_dense
from lightning_hetero.subspace_pipeline.layers import ProjectedLinear, SubspaceEmbedding, SubspaceLinear
from lightning_hetero.subspace_pipeline.optim import SubspaceAdamW
from lightning_hetero.subspace_pipeline.stage_module import StageModule
from lightning_hetero.subspace_pipeline.stages import build_stages, causal_lm_loss, constrained_model, reference_forward

__all__ = [
    "COORD_DTYPES",
    "FixedTokenTable",
    "ProjectedLinear",
    "StageModule",
    "SubspaceAdamW",
    "SubspaceBasis",
    "SubspaceConfig",
    "SubspaceEmbedding",
    "SubspaceLinear",
    "build_stages",
    "causal_lm_loss",
    "constrained_model",
    "dense_state_dict",
    "export_dense",
    "orthonormal_basis",
    "outside_span_fraction",
    "propose_basis",
    "reference_forward",
]
