"""Subspace networks ("Protocol Models"): HF decoders whose stage boundaries carry k numbers per token, losslessly.

Framework-free core (no Lightning imports): the shared basis and Grassmann update (:mod:`.basis`), the confined
layers (:mod:`.layers`), model discovery and surgery (:mod:`.model`), stage modules with the boundary codec
(:mod:`.stages`, :mod:`.codec`), the subspace-preserving optimizer (:mod:`.optim`) and dense export (:mod:`.export`).
The pipeline runtime and the Lightning/Fabric strategies build on these. See ``docs/subspace.md``.
"""

from lightning_hetero.subspace.basis import (
    COORD_DTYPES,
    FixedTokenTable,
    SubspaceBasis,
    SubspaceConfig,
    orthonormal_basis,
    outside_span_fraction,
    propose_basis,
)
from lightning_hetero.subspace.codec import BoundaryCodec
from lightning_hetero.subspace.export import dense_state_dict, export_dense
from lightning_hetero.subspace.layers import ProjectedLinear, SubspaceEmbedding, SubspaceLinear
from lightning_hetero.subspace.model import SUPPORTED_FAMILIES, DecoderParts, constrained_model, find_decoder
from lightning_hetero.subspace.optim import SubspaceAdamW
from lightning_hetero.subspace.stages import (
    StageModule,
    build_stages,
    causal_lm_loss,
    reference_forward,
    split_layers,
)

__all__ = [
    "COORD_DTYPES",
    "SUPPORTED_FAMILIES",
    "BoundaryCodec",
    "DecoderParts",
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
    "find_decoder",
    "orthonormal_basis",
    "outside_span_fraction",
    "propose_basis",
    "reference_forward",
    "split_layers",
]
