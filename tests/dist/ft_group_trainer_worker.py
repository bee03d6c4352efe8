"""One rank of a two-rank node running ``Trainer(devices=2, strategy=FlexDeMoStrategy(fault_tolerance=...))``.

The Trainer counterpart of tests/dist/ft_group_worker.py (same environment: one rank of its node's own ``torchrun
--nnodes 1 --nproc-per-node 2``, ``REPLICA_GROUP_ID``). The model is FSDP2-sharded over the node's two ranks by the
strategy; each node reads its shard of one dataset (``num_replica_groups=2``), each rank its part of that shard. Each
committed step appends a JSON line to ``<out>/group_<id>_rank_<rank>.jsonl`` (committed step, ``global_step``,
participants, pid, SHA-256 of this rank's local parameter shards); ``<out>/stop`` becomes ``max_steps``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from ft_group_worker import Net, digest
from torch import nn
from torch.utils.data import Dataset

from lightning_hetero.data.stateful import StatefulDataLoader
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.replication import ReplicationSettings
from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy


class _Samples(Dataset):
    """Sample ``i`` is a pure function of ``i``: every node holds the same dataset and reads its own shard."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return torch.randn(8, generator=generator), torch.randn(3, generator=generator)


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        return nn.functional.mse_loss(self.net(inputs), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class _Journal(L.Callback):
    def __init__(self, path: Path, stop: Path) -> None:
        self.path, self.stop = path, stop

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        replica = trainer.strategy.runtime.quorum.replica
        record = {
            "step": replica.current_step(),
            "global_step": trainer.global_step,
            "participants": replica.num_participants(),
            "pid": os.getpid(),
            "digest": digest(module),
        }
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        if self.stop.exists():
            trainer.fit_loop.epoch_loop.max_steps = int(self.stop.read_text())  # every node stops at the same step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    group, rank = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"])
    torch.manual_seed(group)  # different initial weights per node: the first quorum syncs them
    settings = FlexDeMoSettings(
        replication=ReplicationSettings(kind="demo", kept_fraction=0.25, chunk=8),
        fault_tolerance=FaultToleranceSettings(
            lighthouse=args.lighthouse,
            min_replicas=1,
            timeout_s=5.0,
            quorum_timeout_s=120.0,
            connect_timeout_s=30.0,
            num_replica_groups=2,
        ),
    )
    path = args.out / f"group_{group}_rank_{rank}.jsonl"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=FlexDeMoStrategy(settings=settings),
        max_epochs=1,
        max_steps=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[_Journal(path, args.out / "stop")],
    )
    module = _Module()
    trainer.fit(module, StatefulDataLoader(_Samples(), batch_size=4))
    with path.open("a") as file:
        file.write(json.dumps({"final": True, "step": trainer.global_step, "digest": digest(module)}) + "\n")


if __name__ == "__main__":
    main()
