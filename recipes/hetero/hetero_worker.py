"""One rank of the mixed-cluster benchmark (``recipes/hetero/bench_hetero.py``): a Lightning Trainer on unequal nodes.

Started by the bandwidth testbed, whose cgroups give each node its own CPU quota and memory limit, so a slow or
small node is slow or small because the kernel says so. Sides:

- ``single``: one process (node A alone);
- ``ddp``: stock Lightning ``DDPStrategy`` (every rank trains the full model at the same micro-batch);
- ``matformer``: ``MatFormerStrategy`` with ``--tiers`` (``auto``: chosen from measurement at fit start, or a JSON
  list) and optionally ``--batch-share``;
- ``flexdemo``: ``FlexDeMoStrategy`` (DCT top-k 1/32, sign, the preconditioned exchange) with ``--batch-share``.

Rank 0 evaluates the **full model** (tier 0 under MatFormer) on the first ``--val-batches`` batches of the
validation split every ``--val-every`` steps, by itself and off the clock: the recorded wall-clock is the training
time since ``trainer.fit`` was called (set-up and any tier/batch probe included, evaluation excluded). Rank 0
writes a JSON summary to ``--out``.

    python recipes/hetero/hetero_worker.py --side single --steps 20 --val-every 10 --out /tmp/single.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_hetero.data import ShakespeareDataModule
from lightning_hetero.models import CausalLMModule

SIDES = ("single", "ddp", "matformer", "flexdemo")


class TrainingClock(L.Callback):
    """Training wall-clock since ``trainer.fit`` (evaluation excluded), per-step times, and the full model's loss.

    Args:
        start: ``time.perf_counter()`` just before ``trainer.fit``.
        val_every: Evaluate every this many optimizer steps (and after the last); 0 never.
        val_batches: How many validation batches (fixed order) each evaluation reads.
    """

    def __init__(self, start: float, val_every: int, val_batches: int) -> None:
        self.start = start
        self.val_every = val_every
        self.val_batches = val_batches
        self.excluded = 0.0  # seconds spent evaluating, taken off the clock
        self.first_step_at: float | None = None
        self.step_seconds: list[float] = []
        self.val_losses: list[tuple[int, float, float]] = []  # (step, training seconds, loss)
        self._step_start = 0.0
        self._batches: list[dict[str, torch.Tensor]] | None = None

    def elapsed(self) -> float:
        """Training seconds since ``trainer.fit`` was called."""
        return time.perf_counter() - self.start - self.excluded

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.first_step_at is None:
            self.first_step_at = self.elapsed()
        self._step_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.step_seconds.append(time.perf_counter() - self._step_start)
        step = trainer.global_step
        last = step >= (trainer.max_steps or 0)
        if trainer.global_rank == 0 and self.val_every and (step % self.val_every == 0 or last):
            began = time.perf_counter()
            loss = self.evaluate(trainer, pl_module)
            self.val_losses.append((step, self.elapsed(), loss))
            self.excluded += time.perf_counter() - began

    @torch.no_grad()
    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float:
        """Mean token loss of rank 0's model (the full model) on the fixed validation batches; no collective."""
        if self._batches is None:
            loader = trainer.datamodule.val_dataloader()
            self._batches = [batch for _, batch in zip(range(self.val_batches), loader, strict=False)]
        model = pl_module.model
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        for batch in self._batches:
            batch = {key: value.to(pl_module.device) for key, value in batch.items()}
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss) * tokens
            count += tokens
        model.train(was_training)
        return total / max(count, 1)


def build_strategy(args: argparse.Namespace) -> Any:
    """The side's strategy object (``"auto"`` for a single process)."""
    share = json.loads(args.batch_share) if args.batch_share not in (None, "auto") else args.batch_share
    if args.side == "single":
        return "auto"
    if args.side == "ddp":
        return DDPStrategy()
    if args.side == "matformer":
        from lightning_hetero import MatFormerSettings, MatFormerStrategy
        from lightning_hetero.hetero.tier_settings import AutoTierSettings

        tiers = args.tiers if args.tiers == "auto" else json.loads(args.tiers)
        options: dict[str, Any] = {"tiers": tiers, "mode": args.mode}
        if tiers == "auto":
            chooser = {"max_slowdown": args.max_slowdown, "memory_headroom": args.memory_headroom}
            options["auto_tiers"] = AutoTierSettings(**{k: v for k, v in chooser.items() if v is not None})
        if share is not None:
            options["batch_share"] = share
        return MatFormerStrategy(settings=MatFormerSettings(**options))
    from lightning_hetero import FlexDeMoSettings, FlexDeMoStrategy

    return FlexDeMoStrategy(settings=FlexDeMoSettings(**({"batch_share": share} if share is not None else {})))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=SIDES, required=True)
    parser.add_argument("--tiers", default="auto", help="matformer: auto, or a JSON list such as [0, 1]")
    parser.add_argument("--mode", default="mean", help="matformer: mean, sign or demo")
    parser.add_argument("--max-slowdown", type=float, default=None, help="matformer tiers auto (default 1.1)")
    parser.add_argument("--memory-headroom", type=float, default=None, help="matformer tiers auto (default 0.1)")
    parser.add_argument("--batch-share", default=None, help="matformer/flexdemo: auto, or a JSON list of shares")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--beta2", type=float, default=0.999, help="AdamW's beta2 (beta1 0.9)")
    parser.add_argument("--lr-warmup", type=int, default=100, help="linear warmup steps before the cosine decay")
    parser.add_argument("--seed", type=int, default=0, help="model initialization seed (the data order is fixed)")
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--model-config", default=None, help="JSON overrides of the preset's config")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (the mean share)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    L.seed_everything(args.seed, verbose=False)
    data = ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size)
    config = json.loads(args.model_config) if args.model_config else None
    module = CausalLMModule(
        preset=args.preset,
        config=config,
        learning_rate=args.learning_rate,
        betas=(0.9, args.beta2),
        warmup_steps=args.lr_warmup,
    )
    strategy = build_strategy(args)
    start = time.perf_counter()
    clock = TrainingClock(start, args.val_every, args.val_batches)
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
    trainer.fit(module, datamodule=data)
    total = clock.elapsed()
    if trainer.global_rank != 0:
        return
    tiers = getattr(trainer.strategy, "tiers", None)
    sizes = getattr(trainer.strategy, "micro_batch_sizes", None)
    steps = clock.step_seconds[5:] or clock.step_seconds
    summary = {
        "side": args.side,
        "preset": args.preset,
        "model_config": config,
        "parameters": sum(p.numel() for p in module.parameters()),
        "world_size": world_size,
        "tiers": tiers if tiers is None else json.loads(json.dumps(tiers)),
        "micro_batch_sizes": list(sizes) if sizes is not None else None,
        "batch_share": args.batch_share,
        "mode": args.mode if args.side == "matformer" else None,
        "batch_size_per_rank": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "learning_rate": args.learning_rate,
        "beta2": args.beta2,
        "lr_warmup": args.lr_warmup,
        "steps": trainer.global_step,
        "setup_seconds": clock.first_step_at,
        "train_seconds": total,
        "median_step_s": statistics.median(steps) if steps else None,
        "val_losses": clock.val_losses,
        "final_val_loss": clock.val_losses[-1][2] if clock.val_losses else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torch_threads": torch.get_num_threads(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
