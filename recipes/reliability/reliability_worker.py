"""One rank of a reliability run: a tiny model trained by one of our strategies, checkpointed every N steps, resumed
from the newest good checkpoint on every (re)start, with an optional injected fault.

Run under torchrun (the elastic agent restarts the job after a fault), usually via
``recipes/reliability/bench_reliability.py``::

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 recipes/reliability/reliability_worker.py \\
        --strategy flexdemo --max-steps 12 --every 4 --out /tmp/rel

The data of step ``s`` depends only on ``s`` (one batch per rank per epoch, drawn from a generator seeded by the
epoch), so a resumed run sees exactly the batches an uninterrupted one does, whatever the data loop does on resume.
Each rank writes ``final_rank<r>.pt`` (its parameters, local shards for sharded strategies); rank 0 appends one
line per attempt to ``attempts.jsonl`` and writes the checkpoint costs to ``saves.json``. A rank that fails writes
``error_rank<r>_attempt<a>.json`` (time, message, explanation). ``LIGHTNING_HETERO_FAULT`` injects the fault (see
:mod:`lightning_hetero.reliability.faults`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler
from typing_extensions import override

from lightning_hetero.callbacks import VerifiedCheckpoint
from lightning_hetero.reliability import FaultPlan, explain_collective_error, latest_good_checkpoint

VOCAB = 64
LLAMA = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}
STRATEGIES = ("flexdemo", "matformer", "subspace", "sparseflip")


class StepData(Dataset):
    """Seeded samples: arithmetic token progressions (Llama) or (features, label) pairs (MLP)."""

    def __init__(self, kind: str, count: int = 512) -> None:
        generator = torch.Generator().manual_seed(1)
        self.kind = kind
        if kind == "tokens":
            starts = torch.randint(0, VOCAB, (count,), generator=generator)
            strides = torch.randint(1, 5, (count,), generator=generator)
            self.ids = (starts[:, None] + torch.arange(12)[None] * strides[:, None]) % VOCAB
        else:
            self.x = torch.randn(count, 16, generator=generator)
            self.y = self.x[:, :4].argmax(dim=1)
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Any:
        if self.kind == "tokens":
            return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}
        return self.x[index], self.y[index]


class EpochBatchSampler(Sampler[int]):
    """One batch per rank per epoch; which samples depends only on the epoch (Lightning calls ``set_epoch``)."""

    def __init__(self, size: int, batch_size: int, num_replicas: int, rank: int) -> None:
        self.size, self.batch_size, self.num_replicas, self.rank, self.epoch = size, batch_size, num_replicas, rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(1000 + self.epoch))
        start = self.rank * self.batch_size
        return iter(order[start : start + self.batch_size].tolist())

    def __len__(self) -> int:
        return self.batch_size


class TinyModule(L.LightningModule):
    """A tiny HF Llama (``kind="tokens"``) or MLP (``kind="mlp"``), constant-LR AdamW, no dropout."""

    def __init__(self, kind: str, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.batch_size = kind, batch_size
        if kind == "tokens":
            from transformers import LlamaConfig, LlamaForCausalLM

            self.model = LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=False))
        else:
            self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kind == "tokens":
            loss = self.model(**batch).loss
        else:
            loss = nn.functional.cross_entropy(self.model(batch[0]), batch[1])
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        data = StepData(self.kind)
        kwargs = self.trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        sampler = EpochBatchSampler(len(data), self.batch_size, kwargs["num_replicas"], kwargs["rank"])
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler)


def build_strategy(name: str, timeout: float) -> Any:
    """The strategy ``name`` with a process-group timeout of ``timeout`` seconds."""
    common = {"timeout": timedelta(seconds=timeout)}
    if name == "flexdemo":
        from lightning_hetero import FlexDeMoStrategy

        return FlexDeMoStrategy(**common)
    if name == "matformer":
        from lightning_hetero import MatFormerStrategy

        return MatFormerStrategy(**common)
    if name == "subspace":
        from lightning_hetero import SubspacePipelineSettings, SubspacePipelineStrategy
        from lightning_hetero.pipeline.settings import PipelineSettings

        replicas = max(1, int(os.environ.get("WORLD_SIZE", "2")) // 2)
        pipeline = PipelineSettings(num_stages=2, data_parallel_size=replicas)
        settings = SubspacePipelineSettings(pipeline=pipeline, subspace_dim=8, n_microbatches=2)
        return SubspacePipelineStrategy(settings=settings, **common)
    from lightning_hetero import SparseFlipSettings, SparseFlipStrategy
    from lightning_hetero.sparseflip.settings import FlipSettings

    settings = SparseFlipSettings(flip=FlipSettings(max_per_step=16, bop_gamma=0.3))
    return SparseFlipStrategy(settings=settings, **common)


class FaultsAndRecords(L.Callback):
    """Fires the planned fault, records attempts, errors and the final parameters."""

    def __init__(self, out: Path, checkpoints: Path, resumed_from: Path | None, saver: VerifiedCheckpoint) -> None:
        self.out, self.checkpoints, self.resumed_from, self.saver = out, checkpoints, resumed_from, saver
        plan = FaultPlan.from_env()
        self.plan = None if plan is None else FaultPlan(plan.kind, plan.rank, plan.step, attempt=None)
        attempts = out / "attempts.jsonl"
        self.attempt = len(attempts.read_text().splitlines()) if attempts.is_file() else 0

    def _fire(self, kind: str, trainer: L.Trainer) -> None:
        # Once per job: the marker file, not TORCHELASTIC_RESTART_COUNT, which each node's agent counts on its own
        # (an agent restarting because of the other node's failure may not count it).
        marker = self.out / "fault.json"
        if (
            self.plan is not None
            and not marker.exists()
            and self.plan.applies(kind, trainer.global_rank, trainer.global_step)
        ):
            record = {"kind": kind, "rank": trainer.global_rank, "step": trainer.global_step, "time": time.time()}
            marker.write_text(json.dumps(record))
            self.plan.maybe_fire(kind, trainer.global_rank, trainer.global_step, self.checkpoints)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            record = {
                "attempt": self.attempt,
                "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                "resumed_from": self.resumed_from.name if self.resumed_from else None,
                "start_step": trainer.global_step,
                "time": time.time(),
            }
            with open(self.out / "attempts.jsonl", "a") as stream:
                stream.write(json.dumps(record) + "\n")

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for kind in ("kill", "stop", "corrupt-kill"):
            self._fire(kind, trainer)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._fire("save-kill", trainer)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        timeout = getattr(trainer.strategy, "_timeout", None)
        explanation = explain_collective_error(exception, timeout)
        record = {"time": time.time(), "error": f"{type(exception).__name__}: {exception}"[:2000]}
        record["explanation"] = explanation
        name = f"error_rank{trainer.global_rank}_attempt{self.attempt}.json"
        (self.out / name).write_text(json.dumps(record, indent=1))
        print(f"[rank {trainer.global_rank}] {explanation or record['error'][:300]}", flush=True)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = {}
        for name, value in pl_module.named_parameters():
            local = value.to_local() if hasattr(value, "to_local") else value
            params[name] = local.detach().cpu().clone()
        torch.save(params, self.out / f"final_rank{trainer.global_rank}.pt")
        if trainer.is_global_zero:
            (self.out / "saves.json").write_text(json.dumps(self.saver.saves, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps (0: never)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoints = args.out / "checkpoints"
    resume = latest_good_checkpoint(checkpoints) if args.every else None
    num_nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    saver = VerifiedCheckpoint(dirpath=checkpoints, every_n_train_steps=max(args.every, 1))
    callbacks: list[L.Callback] = [FaultsAndRecords(args.out, checkpoints, resume, saver)]
    if args.every:
        callbacks.append(saver)
    kind = "mlp" if args.strategy == "sparseflip" else "tokens"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=num_nodes,
        strategy=build_strategy(args.strategy, args.timeout),
        max_steps=args.max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(args.every),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    trainer.fit(TinyModule(kind, args.batch_size), ckpt_path=resume)


if __name__ == "__main__":
    main()
