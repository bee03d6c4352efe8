"""One rank of the SmolLM2-135M benchmarks: stock Lightning DDP, MatFormerStrategy (mixed tiers), or one process.

Started by ``recipes/matformer/bench_matformer_smollm2.py`` through ``torchrun`` (ranks on this machine) or the
bandwidth testbed (one rank per network-namespace "node"). Both give a torchrun-style environment, so Lightning does not
spawn. The model is SmolLM2-135M with its real (GGUF-dequantized) weights, saved once as safetensors by the benchmark's
``prepare`` step, fine-tuned on Shakespeare with the model's own tokenizer.

Per optimizer step, every rank records:

- ``compute_s``: forward + backward (``on_train_batch_start`` -> ``on_after_backward``) plus the optimizer step
  (``on_before_optimizer_step`` -> ``on_train_batch_end``). Under MatFormer the gradient exchange runs between those
  two (the strategy's ``post_backward``), so this is compute alone; under stock DDP the all-reduce overlaps the
  backward and is inside it.
- ``sync_s``: ``on_after_backward`` -> ``on_before_optimizer_step`` (MatFormer's exchange, and waiting for the peer).
- ``ledger_sent``: bytes this rank sent on the ``inter`` label of our byte ledger (MatFormer only; stock DDP does
  not go through it), and ``wire_tx``/``wire_rx``: this node's ``eth0`` counters (testbed only).

Rank 0 evaluates the validation loss of ``--eval-tiers`` (a tier's forward on the full weights via ``tier_view``) on
the same ``--val-batches`` batches before and after training. Every rank writes ``<out>.rank<k>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_hetero.comm.ledger import get_ledger
from lightning_hetero.data import ShakespeareDataModule
from lightning_hetero.matformer.slicing import tier_view
from lightning_hetero.models import CausalLMModule

COUNTERS = Path("/sys/class/net/eth0/statistics")


def read_wire_bytes() -> tuple[int, int] | None:
    """(tx, rx) bytes of this namespace's eth0, or None outside the testbed."""
    try:
        return int((COUNTERS / "tx_bytes").read_text()), int((COUNTERS / "rx_bytes").read_text())
    except OSError:
        return None


class StepClock(L.Callback):
    """Compute and gradient-sync seconds, ledger bytes and wire bytes of every optimizer step (no accumulation)."""

    def __init__(self, wire: bool) -> None:
        self.wire = wire
        self.rows: list[dict[str, float]] = []
        self.parameters_held = 0  # during training (after MatFormer's slicing; the full model is restored at the end)
        self._marks: dict[str, float] = {}
        self._start_counts: tuple[int, tuple[int, int] | None] = (0, None)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._start_counts = (get_ledger().totals("inter").sent, read_wire_bytes() if self.wire else None)
        if not self.parameters_held:
            self.parameters_held = sum(p.numel() for p in pl_module.parameters())
        self._marks = {"start": time.perf_counter()}

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._marks["backward_done"] = time.perf_counter()

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._marks["synced"] = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        end, marks = time.perf_counter(), self._marks
        row = {
            "step_s": end - marks["start"],
            "compute_s": (marks["backward_done"] - marks["start"]) + (end - marks["synced"]),
            "sync_s": marks["synced"] - marks["backward_done"],
            "ledger_sent": get_ledger().totals("inter").sent - self._start_counts[0],
        }
        wire_start, wire_end = self._start_counts[1], read_wire_bytes() if self.wire else None
        if wire_start is not None and wire_end is not None:
            row["wire_tx"], row["wire_rx"] = wire_end[0] - wire_start[0], wire_end[1] - wire_start[1]
        self.rows.append(row)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], tiers: list[int]) -> dict[str, float]:
    """Mean validation loss of each tier on ``batches`` (tier 0: the full model)."""
    was_training = model.training
    model.eval()
    losses = {}
    for tier in tiers:
        with tier_view(model, tier) if tier else _nothing():
            values = [float(model(**batch).loss) for batch in batches]
        losses[f"tier{tier}"] = sum(values) / len(values)
    model.train(was_training)
    return losses


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def launch_layout_and_data(args: argparse.Namespace) -> tuple[int, int, int, ShakespeareDataModule]:
    """World size, ranks per node and rank from the launcher's environment; seeds everything; Shakespeare with the
    model's own tokenizer (``args.seq_len``, ``args.batch_size``, ``args.model_dir``, ``args.seed``)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    L.seed_everything(args.seed, verbose=False)
    data = ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size, tokenizer=str(args.model_dir))
    return world_size, ranks_per_node, rank, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["single", "ddp", "matformer"], required=True)
    parser.add_argument("--model-dir", type=Path, required=True, help="the prepared full SmolLM2 checkpoint")
    parser.add_argument("--tiers", default="0", help="matformer: comma-separated tier of every rank")
    parser.add_argument("--mode", default="mean", help="matformer: mean, sign or demo")
    parser.add_argument("--kept-fraction", type=float, default=None, help="matformer demo: DCT coefficients kept")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--eval-tiers", default="0", help="comma-separated tiers rank 0 evaluates before/after")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="prefix: writes <out>.rank<k>.json")
    parser.add_argument("--wire-counters", action="store_true", help="read eth0 counters (only inside the testbed)")
    args = parser.parse_args()

    world_size, ranks_per_node, rank, data = launch_layout_and_data(args)
    # Constant LR after a 1-step warmup (the schedule's cosine floor at min_lr_ratio=1.0): a short run must not
    # spend half its steps warming up; the same schedule for every strategy.
    module = CausalLMModule(
        pretrained=str(args.model_dir), learning_rate=args.learning_rate, warmup_steps=1, min_lr_ratio=1.0
    )
    eval_tiers = [int(t) for t in args.eval_tiers.split(",")]
    before: dict[str, float] = {}
    batches: list[dict[str, torch.Tensor]] = []
    if rank == 0:
        data.setup("fit")
        batches = [batch for _, batch in zip(range(args.val_batches), data.val_dataloader(), strict=False)]
        module.configure_model()  # build once here; the Trainer's configure_model call is then a no-op
        before = evaluate(module.model, batches, eval_tiers)
        module.model.train()  # HF loads models in eval mode; train like the ranks that built theirs in fit
    if args.strategy == "single":
        strategy: Any = "auto"
    elif args.strategy == "ddp":
        strategy = DDPStrategy()
    else:
        from lightning_hetero import MatFormerStrategy
        from lightning_hetero.matformer.settings import MatFormerSettings
        from lightning_hetero.replication.settings import ReplicationSettings

        tiers = [int(t) for t in args.tiers.split(",")]
        kept = None if args.kept_fraction is None else ReplicationSettings(kept_fraction=args.kept_fraction)
        strategy = MatFormerStrategy(settings=MatFormerSettings(tiers=tiers, mode=args.mode, replication=kept))
    clock = StepClock(wire=args.wire_counters)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ranks_per_node,
        num_nodes=world_size // ranks_per_node,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    started = time.perf_counter()
    trainer.fit(module, datamodule=data)
    fit_seconds = time.perf_counter() - started
    after = evaluate(module.model, batches, eval_tiers) if rank == 0 else {}
    measured = clock.rows[args.warmup :]
    summary = {
        "strategy": args.strategy,
        "rank": rank,
        "world_size": world_size,
        "nodes": world_size // ranks_per_node,
        "tiers": args.tiers if args.strategy == "matformer" else None,
        "tier": int(args.tiers.split(",")[rank]) if args.strategy == "matformer" else 0,
        "mode": args.mode if args.strategy == "matformer" else None,
        "learning_rate": args.learning_rate,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "torch_threads": torch.get_num_threads(),
        "parameters_held": clock.parameters_held,
        "fit_seconds": fit_seconds,
        "val_loss_before": before,
        "val_loss_after": after,
        "val_batches": args.val_batches,
        "steps_recorded": clock.rows,
        "median_step_s": median([row["step_s"] for row in measured]),
        "median_compute_s": median([row["compute_s"] for row in measured]),
        "median_sync_s": median([row["sync_s"] for row in measured]),
        "median_ledger_sent_per_step": median([row["ledger_sent"] for row in measured]),
        "median_wire_tx_per_step": median([row["wire_tx"] for row in measured if "wire_tx" in row]),
        "median_wire_rx_per_step": median([row["wire_rx"] for row in measured if "wire_rx" in row]),
    }
    if any(math.isnan(v) for v in after.values()):
        summary["diverged"] = True
    out = Path(f"{args.out}.rank{rank}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
