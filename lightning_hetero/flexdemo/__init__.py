"""FlexDeMo: FSDP2 inside a node, decoupled-momentum compressed replication between nodes (DeToNATION).

Framework-free core: the optimizers (:mod:`~lightning_hetero.flexdemo.optim`, on the
:mod:`~lightning_hetero.flexdemo.replicating` protocol) that drive the replicators of
:mod:`lightning_hetero.replication` (chunked DCT, the replicators that exchange (compressed) updates over the replicate
group; shared with MatFormer's ``demo`` mode), plus :mod:`lightning_hetero.comm.payload_packing`.
See ``docs/flexdemo.md``.
"""

from lightning_hetero.flexdemo.optim import DecoupledAdamW, DeMoSGD
from lightning_hetero.flexdemo.replicating import ReplicatingOptimizer, local_tensor

__all__ = ["DeMoSGD", "DecoupledAdamW", "ReplicatingOptimizer", "local_tensor"]
