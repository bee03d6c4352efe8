"""One replica group (one rank) of a fault-tolerant FlexDeMo run in the Lightning Trainer (tests/dist/test_ft_flexdemo).

Each replica group is its own launch (here: one process with a torchrun-style environment: ``RANK=0``,
``WORLD_SIZE=1``, ``MASTER_PORT`` of its own, ``REPLICA_GROUP_ID``), running ``Trainer(strategy=FlexDeMoStrategy(
settings=FlexDeMoSettings(fault_tolerance=...)))`` on the small regression MLP of ``spot_worker.py``, on its own data
stream (a :class:`~lightning_hetero.data.stateful.StatefulDataLoader` over batch indices, so a rejoining node continues
at the survivors' position of its own stream). After every optimizer step (each one committed: a discarded try is
retried) it appends one JSON line to ``<out>/replica_<id>.jsonl``: the committed step, ``global_step``, the batch index
trained, the participants, the retries, the pid, the time, the loss, ``comm/inter/bytes_sent_step`` and the replicator's
payload bytes, and a SHA-256 of the weights. Once ``<out>/stop`` holds a number, it becomes the Trainer's
``max_steps``. A refused recovery checkpoint ends the process with exit code 3 and the message in
``<out>/replica_<id>.error``.

    REPLICA_GROUP_ID=0 python recipes/spot_trainer_worker.py --lighthouse http://localhost:29510 --out /tmp/spot
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
from torch.utils.data import Dataset

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.data.stateful import StatefulDataLoader
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.replication import ReplicationSettings
from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spot_worker import FEATURES, batch, digest, forbid_pickle  # noqa: E402 - the recipe's own helpers


class Stream(Dataset):
    """This replica group's batches by index (each replica group reads its own data), with the index attached."""

    def __init__(self, replica: int, length: int = 10**6) -> None:
        self.replica = replica
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (*batch(index, self.replica), torch.tensor(index))


class Regression(L.LightningModule):
    """The MLP of ``spot_worker.build`` (same seed on every replica group; torchft's first quorum syncs anyway)."""

    def __init__(self, hidden: int = 16, lr: float = 0.02, step_sleep: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(1000)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.lr = lr
        self.step_sleep = step_sleep
        self.last_loss = 0.0
        self.last_index = -1

    def training_step(self, data: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target, index = data
        loss = torch.nn.functional.mse_loss(self.net(inputs), target)
        self.last_loss = float(loss.detach())
        self.last_index = int(index)
        time.sleep(self.step_sleep)  # "compute": gives a kill time to land mid-run
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)  # FlexDeMo converts it to DecoupledAdamW


class Journal(L.Callback):
    """One JSON line per committed step; ``<out>/stop`` sets ``max_steps`` (global_step counts committed steps)."""

    def __init__(self, out: Path, replica: int) -> None:
        self.path = out / f"replica_{replica}.jsonl"
        self.stop_file = out / "stop"

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, data: Any, batch_idx: int) -> None:
        runtime = trainer.strategy.runtime
        replica = runtime.replica
        sent = trainer.callback_metrics.get("comm/inter/bytes_sent_step")
        record = {
            "step": replica.current_step(),
            "global_step": trainer.global_step,
            "batch_index": module.last_index,
            "participants": replica.num_participants(),
            "retries": runtime.last_retries,
            "pid": os.getpid(),
            "time": time.time(),
            "loss": module.last_loss,
            "inter_bytes_sent": None if sent is None else int(sent),
            "payload_bytes": runtime.optimizer.comm_stats().get("payload_bytes"),
            "digest": digest(module),
        }
        with self.path.open("a") as log:
            log.write(json.dumps(record) + "\n")
        text = self.stop_file.read_text().strip() if self.stop_file.exists() else ""
        if text:
            trainer.fit_loop.epoch_loop.max_steps = int(text)  # every node stops at the same committed step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=16, help="hidden width (another width = another layout)")
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds of 'compute' per step")
    parser.add_argument("--forbid-pickle", action="store_true", help="make every unpickling call raise")
    parser.add_argument(
        "--shard-groups",
        type=int,
        default=None,
        help="one stream for all nodes, each reading its shard (FaultToleranceSettings.num_replica_groups)",
    )
    args = parser.parse_args(argv)
    if args.forbid_pickle:
        forbid_pickle()
    replica = int(os.environ["REPLICA_GROUP_ID"])
    args.out.mkdir(parents=True, exist_ok=True)
    settings = FlexDeMoSettings(
        replication=ReplicationSettings(kind="demo", kept_fraction=0.25, chunk=4),
        fault_tolerance=FaultToleranceSettings(
            lighthouse=args.lighthouse,
            min_replicas=args.min_replicas,
            timeout_s=args.timeout,
            quorum_timeout_s=120.0,
            connect_timeout_s=30.0,
            num_replica_groups=args.shard_groups,
        ),
    )
    module = Regression(args.hidden, step_sleep=args.step_sleep)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=1,
        strategy=FlexDeMoStrategy(settings=settings),
        max_epochs=1,
        max_steps=-1,
        use_distributed_sampler=False,  # one rank per launch: the node's own stream, in order
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Journal(args.out, replica)],
    )
    try:
        stream = Stream(0 if args.shard_groups else replica)  # sharded: one dataset, each node its own shard
        trainer.fit(module, StatefulDataLoader(stream, batch_size=None))
    except PeerPayloadError as error:
        (args.out / f"replica_{replica}.error").write_text(f"{type(error).__name__}: {error}\n")
        return 3
    final = {"final": True, "global_step": trainer.global_step, "digest": digest(module)}
    with (args.out / f"replica_{replica}.jsonl").open("a") as log:
        log.write(json.dumps(final) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
