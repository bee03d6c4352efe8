"""One rank of a replica group running ``Trainer(devices=N, strategy=FlexDeMoStrategy(fault_tolerance=...))``.

The Trainer counterpart of tests/dist/ft_group_worker.py (same environment: one rank of its node's own ``torchrun
--nnodes 1 --nproc-per-node N``, ``REPLICA_GROUP_ID``), for tests/dist/test_ft_replica_groups.py (2 ranks per node,
the model FSDP2-sharded over them), test_ft_flexdemo.py and test_ft_data.py (1 rank per node). Each node reads its own
stream of batches (sample ``i`` of stream ``s`` is a pure function of both, so a rejoining node continues at the
survivors' position of its own stream) or, with ``--shard-groups``, its shard of one stream
(``FaultToleranceSettings.num_replica_groups``; each rank its part of that shard).

Each committed step appends a JSON line to ``<out>/group_<id>_rank_<rank>.jsonl``: the committed step,
``global_step``, the batch index trained, participants, retries, pid, ``comm/inter/bytes_sent_step``, the replicator's
payload bytes and the SHA-256 of this rank's local parameter shards. ``<out>/stop`` becomes ``max_steps``; the last
line (``final``) holds ``global_step`` and the digest. A refused recovery checkpoint ends the process with exit code 3
and the message in ``<out>/group_<id>.error``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from ft_group_worker import Net
from ft_support import StepJournal, digest
from torch import nn
from torch.utils.data import Dataset

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.data.stateful import StatefulDataLoader
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.replication import ReplicationSettings
from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy
from lightning_hetero.testing.no_pickle import forbid_pickle


class _Batches(Dataset):
    """Batch ``i`` of stream ``stream`` (4 samples) with its index attached; the loader does not batch again."""

    def __init__(self, stream: int) -> None:
        self.stream = stream

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1_000_003 * self.stream + index)
        return torch.randn(4, 8, generator=generator), torch.randn(4, 3, generator=generator), torch.tensor(index)


class _Module(L.LightningModule):
    def __init__(self, hidden: int, step_sleep: float) -> None:
        super().__init__()
        self.net = Net(hidden)
        self.step_sleep = step_sleep
        self.last_index = -1

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        inputs, target, index = batch
        self.last_index = int(index)
        time.sleep(self.step_sleep)  # "compute": gives a kill time to land mid-run
        return nn.functional.mse_loss(self.net(inputs), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _flexdemo_fields(trainer: L.Trainer, module: Any) -> dict[str, Any]:
    return {
        "batch_index": module.last_index,
        "payload_bytes": trainer.strategy.runtime.optimizer.comm_stats().get("payload_bytes"),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--shard-groups", type=int, default=None, help="num_replica_groups: one stream, sharded")
    parser.add_argument("--hidden", type=int, default=16, help="another width is another layout (an impostor)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of 'compute' per step")
    parser.add_argument("--forbid-pickle", action="store_true")
    args = parser.parse_args()
    if args.forbid_pickle:
        forbid_pickle()
    group, rank, ranks = (int(os.environ[name]) for name in ("REPLICA_GROUP_ID", "RANK", "WORLD_SIZE"))
    torch.manual_seed(group)  # different initial weights per node: the first quorum syncs them
    settings = FlexDeMoSettings(
        replication=ReplicationSettings(kind="demo", kept_fraction=0.25, chunk=8),
        fault_tolerance=FaultToleranceSettings(
            lighthouse=args.lighthouse,
            min_replicas=args.min_replicas,
            timeout_s=5.0,
            quorum_timeout_s=120.0,
            connect_timeout_s=30.0,
            num_replica_groups=args.shard_groups,
        ),
    )
    path = args.out / f"group_{group}_rank_{rank}.jsonl"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ranks,
        num_nodes=1,
        strategy=FlexDeMoStrategy(settings=settings),
        max_epochs=1,
        max_steps=-1,
        use_distributed_sampler=False,  # the node's stream in order; the strategy cuts the shards
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[StepJournal(path, args.out / "stop", _flexdemo_fields)],
    )
    module = _Module(args.hidden, args.step_sleep)
    stream = 0 if args.shard_groups else group
    try:
        trainer.fit(module, StatefulDataLoader(_Batches(stream), batch_size=None))
    except PeerPayloadError as error:
        (args.out / f"group_{group}.error").write_text(f"{type(error).__name__}: {error}\n")
        return 3
    with path.open("a") as file:
        record = {"final": True, "step": trainer.global_step, "global_step": trainer.global_step}
        file.write(json.dumps({**record, "digest": digest(module)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
