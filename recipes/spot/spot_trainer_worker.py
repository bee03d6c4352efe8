"""One replica group (one rank) of a fault-tolerant FlexDeMo run in the Lightning Trainer (tests/dist/test_ft_flexdemo).

Each replica group is its own launch (here: one process with a torchrun-style environment: ``RANK=0``,
``WORLD_SIZE=1``, ``MASTER_PORT`` of its own, ``REPLICA_GROUP_ID``), running ``Trainer(strategy=FlexDeMoStrategy(
settings=FlexDeMoSettings(fault_tolerance=...)))`` on the small regression MLP of ``spot_worker.py``, on its own data
stream (a :class:`~lightning_hetero.data.stateful.StatefulDataLoader` over batch indices, so a rejoining node continues
at the survivors' position of its own stream). After every optimizer step (each one committed: a discarded try is
retried) it appends one JSON line to ``<out>/replica_<id>.jsonl``: the committed step, ``global_step``, the batch index
trained, the participants, the retries, the pid, the time, the loss, ``comm/inter/bytes_sent_step`` and the replicator's
payload bytes, a SHA-256 of the weights, a hash of the batch it trained (``batch_hash``) with its position
(``epoch``, ``batch_idx``), and the step's wall and exchange seconds. Once ``<out>/stop`` holds a number, it becomes
the Trainer's ``max_steps``; the last line (``final``) holds the weights' hash and, with ``--val-batches``, the
validation loss. A refused recovery checkpoint ends the process with exit code 3 and the message in
``<out>/replica_<id>.error``.

``--corpus shakespeare`` trains ``CausalLMModule`` (llama-tiny) on ``ShakespeareDataModule`` instead (a real corpus
through our DataModule; ``--shard-groups`` then gives each node its shard of the one training set).

    REPLICA_GROUP_ID=0 python recipes/spot/spot_trainer_worker.py --lighthouse http://localhost:29510 --out /tmp/spot
"""

from __future__ import annotations

import argparse
import hashlib
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
from lightning_hetero.data.shakespeare import ShakespeareDataModule
from lightning_hetero.data.stateful import StatefulDataLoader
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.models.causal_lm import CausalLMModule
from lightning_hetero.replication import ReplicationSettings
from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy
from lightning_hetero.testing.no_pickle import forbid_pickle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spot_worker import FEATURES, batch, digest  # noqa: E402 - the recipe's own helpers


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


def batch_hash(data: Any) -> str:
    """SHA-256 (16 hex digits) of the batch's inputs: equal batches, equal hashes, on any node."""
    inputs = data["input_ids"] if isinstance(data, dict) else data[0]
    return hashlib.sha256(inputs.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _loss_of(outputs: Any) -> float:
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan")


class Journal(L.Callback):
    """One JSON line per committed step; ``<out>/stop`` sets ``max_steps`` (global_step counts committed steps)."""

    def __init__(self, out: Path, replica: int) -> None:
        self.path = out / f"replica_{replica}.jsonl"
        self.stop_file = out / "stop"
        self.started = time.time()

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, data: Any, batch_idx: int) -> None:
        self.started = time.time()

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, data: Any, batch_idx: int) -> None:
        runtime = trainer.strategy.runtime
        if runtime.quorum.last_abandoned:
            return  # a batch drawn for a step committed without this node: dropped, not trained
        replica = runtime.quorum.replica
        sent = trainer.callback_metrics.get("comm/inter/bytes_sent_step")
        stats = runtime.optimizer.comm_stats()
        now = time.time()
        record = {
            "step": replica.current_step(),
            "global_step": trainer.global_step,
            "batch_index": getattr(module, "last_index", None),
            "batch_hash": batch_hash(data),
            "epoch": trainer.current_epoch,
            "batch_idx": batch_idx,
            "batches_per_epoch": trainer.num_training_batches,
            "participants": replica.num_participants(),
            "retries": runtime.quorum.last_retries,
            "abandoned": runtime.quorum.abandoned_batches,
            "pid": os.getpid(),
            "time": now,
            "step_s": now - self.started,
            "comm_s": stats.get("comm_seconds"),
            "loss": _loss_of(outputs),
            "inter_bytes_sent": None if sent is None else int(sent),
            "payload_bytes": stats.get("payload_bytes"),
            "digest": digest(module),
        }
        with self.path.open("a") as log:
            log.write(json.dumps(record) + "\n")
        text = self.stop_file.read_text().strip() if self.stop_file.exists() else ""
        if text:
            trainer.fit_loop.epoch_loop.max_steps = int(text)  # every node stops at the same committed step


@torch.no_grad()
def validation_loss(module: L.LightningModule, data: ShakespeareDataModule, batches: int) -> float:
    """Mean loss of the first ``batches`` validation batches (a fixed seeded order: the same batches on every run)."""
    module.eval()
    losses = []
    for index, examples in enumerate(data.val_dataloader()):
        if index >= batches:
            break
        losses.append(float(module(**examples).loss))
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=16, help="hidden width (another width = another layout)")
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--quorum-timeout", type=float, default=120.0, help="FaultToleranceSettings.quorum_timeout_s")
    parser.add_argument("--wait-for-replicas", type=float, default=600.0, help="... .wait_for_replicas_s")
    parser.add_argument("--require-secret", action="store_true", help="refuse to start without the cluster secret")
    parser.add_argument("--kept-fraction", type=float, default=0.25, help="DeMo's kept fraction")
    parser.add_argument("--chunk", type=int, default=4, help="DeMo's chunk (configs/flexdemo_spot.yaml: 64)")
    parser.add_argument("--values", default="fp32", help="DeMo's value encoding (configs/flexdemo_spot.yaml: bf16)")
    parser.add_argument("--corpus", choices=("synthetic", "shakespeare"), default="synthetic")
    parser.add_argument("--seq-len", type=int, default=64, help="shakespeare: tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="shakespeare: sequences per batch")
    parser.add_argument("--val-batches", type=int, default=0, help="shakespeare: validation batches at the end")
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
        replication=ReplicationSettings(
            kind="demo", kept_fraction=args.kept_fraction, chunk=args.chunk, values=args.values
        ),
        fault_tolerance=FaultToleranceSettings(
            lighthouse=args.lighthouse,
            min_replicas=args.min_replicas,
            timeout_s=args.timeout,
            quorum_timeout_s=args.quorum_timeout,
            connect_timeout_s=30.0,
            num_replica_groups=args.shard_groups,
            wait_for_replicas_s=args.wait_for_replicas,
            require_secret=args.require_secret,
        ),
    )
    data: ShakespeareDataModule | None = None
    if args.corpus == "shakespeare":
        # Same data seed on every node: one split and one tokenizer; the shard comes from num_replica_groups.
        data = ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size, seed=42)
        torch.manual_seed(1000)
        module: L.LightningModule = CausalLMModule("llama-tiny", learning_rate=3e-3, warmup_steps=25)
    else:
        module = Regression(args.hidden, step_sleep=args.step_sleep)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=1,
        strategy=FlexDeMoStrategy(settings=settings),
        max_epochs=-1,  # epochs over the node's shard until <out>/stop: a shard of 1/3 ends 3x sooner than the set
        max_steps=-1,
        limit_val_batches=0,  # validation once, at the end (validation_loss): no pause at every shard's epoch end
        use_distributed_sampler=False,  # one rank per launch: the node's own stream, in order
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Journal(args.out, replica)],
    )
    try:
        if data is not None:
            trainer.fit(module, datamodule=data)
        else:
            stream = Stream(0 if args.shard_groups else replica)  # sharded: one dataset, each node its own shard
            trainer.fit(module, StatefulDataLoader(stream, batch_size=None))
    except PeerPayloadError as error:
        (args.out / f"replica_{replica}.error").write_text(f"{type(error).__name__}: {error}\n")
        return 3
    final: dict[str, Any] = {"final": True, "global_step": trainer.global_step, "digest": digest(module)}
    if data is not None and args.val_batches > 0:
        final["val_loss"] = validation_loss(module, data, args.val_batches)
    with (args.out / f"replica_{replica}.jsonl").open("a") as log:
        log.write(json.dumps(final) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
