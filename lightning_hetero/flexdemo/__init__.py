"""FlexDeMo: FSDP2 inside a node, decoupled-momentum compressed replication between nodes (DeToNATION).

Framework-free core (this package's ``transforms``, ``replicators`` and ``optim`` modules, plus
:mod:`lightning_hetero.comm.codecs`): the chunked DCT, the replicators that exchange (compressed) updates over the
replicate group, and the optimizers that drive them. See ``docs/flexdemo.md``.
"""

from lightning_hetero.flexdemo.optim import DecoupledAdamW, DeMoSGD, ReplicatingOptimizer, local_tensor
from lightning_hetero.flexdemo.replicators import (
    COMBINE_MODES,
    REPLICATORS,
    DeMoReplicator,
    DiLoCoReplicator,
    FullReplicator,
    RandomReplicator,
    Replicator,
    StridingReplicator,
    TopKReplicator,
    build_replicator,
)
from lightning_hetero.flexdemo.transforms import BlockLayout, ChunkedDCT, FlatChunks, dct_basis, matrix_view

__all__ = [
    "COMBINE_MODES",
    "REPLICATORS",
    "BlockLayout",
    "ChunkedDCT",
    "DeMoReplicator",
    "DeMoSGD",
    "DecoupledAdamW",
    "DiLoCoReplicator",
    "FlatChunks",
    "FullReplicator",
    "RandomReplicator",
    "ReplicatingOptimizer",
    "Replicator",
    "StridingReplicator",
    "TopKReplicator",
    "build_replicator",
    "dct_basis",
    "local_tensor",
    "matrix_view",
]
