"""One rank of ``recipes/finetune/bench_finetune_smollm2.py``: SmolLM2-135M fine-tuned on Shakespeare by one strategy.

Started on every rank by the bandwidth testbed (one rank per network-namespace "node", torchrun-style environment)
or, for the compute-only run, as one plain process. Strategies:

- ``single``: one process, stock Lightning, AdamW (compute only: no communication; gives R's denominator);
- ``ddp``: stock Lightning ``DDPStrategy``, AdamW;
- ``flexdemo``: ``FlexDeMoStrategy`` (``--replicator`` demo, ``--compression`` 1/32, ``--values`` sign), whose
  AdamW becomes DeMo's decoupled AdamW with the same hyperparameters;
- ``pipeline``: :class:`~lightning_hetero.subspace_pipeline.runtime.SubspacePipelineRuntime`, one stage per rank,
  ``--compress``/``--no-compress`` (subspace at ``d/k = --ssn-compression`` with ``--coord-dtype``, or the plain
  uncompressed pipeline), 1F1B over ``--microbatches``, AdamW on the stage's parameters.

Every run evaluates the same ``--val-batches`` validation batches (``--val-batch-size`` sequences each, the first
batches of the validation split) before and after training. The pipeline also evaluates right after the model is
split (and, with compression, constrained into the subspace), which is where converting a pretrained checkpoint
loses quality. Per step the rank records its step time, its compute time where the strategy separates it, the bytes
it sent on the byte ledger's inter-node label (``inter`` for FlexDeMo, ``pipeline`` for the pipeline; stock DDP does
not use the ledger) and, inside the testbed, its node's ``eth0`` byte counters. Every rank writes
``<out>.rank<k>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "matformer"))  # the SmolLM2 MatFormer worker's helpers
from matformer_smollm2_worker import StepClock, launch_layout_and_data, read_wire_bytes  # noqa: E402

from lightning_hetero import comm  # noqa: E402
from lightning_hetero.data import ShakespeareDataModule  # noqa: E402
from lightning_hetero.models import CausalLMModule  # noqa: E402


class FinetuneLM(CausalLMModule):
    """The reference causal LM, optionally cut to its first ``keep_layers`` decoder layers (smoke runs only)."""

    def __init__(self, keep_layers: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.keep_layers = keep_layers

    @override
    def configure_model(self) -> None:
        first = self.model is None
        super().configure_model()
        if first and self.keep_layers:
            decoder = self.model.model
            decoder.layers = decoder.layers[: self.keep_layers]
            self.model.config.num_hidden_layers = self.keep_layers


def val_batches(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """The fixed held-out set: the first ``--val-batches`` batches of the validation split (no shuffling)."""
    data = ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.val_batch_size, tokenizer=str(args.model_dir))
    data.setup("fit")
    return [batch for _, batch in zip(range(args.val_batches), data.val_dataloader(), strict=False)]


@torch.no_grad()
def dense_val_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean over ``batches`` of the HF model's mean token cross-entropy."""
    was_training = model.training
    model.eval()
    value = statistics.fmean(float(model(**batch).loss) for batch in batches)
    model.train(was_training)
    return value


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(args: argparse.Namespace, rows: list[dict[str, float]], extra: dict[str, Any]) -> dict[str, Any]:
    """Per-rank JSON: settings, every step's row, medians over the steps after ``--warmup``."""
    measured = rows[args.warmup :] or rows
    summary = {
        "strategy": args.strategy,
        "rank": int(os.environ.get("RANK", "0")),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "learning_rate": args.learning_rate,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "torch_threads": torch.get_num_threads(),
        "val_batches": args.val_batches,
        "val_batch_size": args.val_batch_size,
        "steps_recorded": rows,
        **extra,
    }
    for key in ("step_s", "compute_s", "sync_s", "ledger_sent", "wire_tx", "wire_rx"):
        summary[f"median_{key}"] = median([row[key] for row in measured if key in row])
    summary["train_losses"] = [row["loss"] for row in rows if "loss" in row]
    after = extra.get("val_loss_after")
    summary["diverged"] = after is not None and not math.isfinite(after)
    return summary


# ---------------------------------------------------------------------------------------------- Lightning runs
class LossRecorder(L.Callback):
    """The training loss of every step (what ``training_step`` returned)."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if self.clock.rows:
            self.clock.rows[-1]["loss"] = float(loss)


def flexdemo_strategy(args: argparse.Namespace) -> Any:
    """The Trainer ``FlexDeMoStrategy`` of ``--replicator``, ``--compression`` (the kept fraction) and ``--values``."""
    from lightning_hetero import FlexDeMoSettings, FlexDeMoStrategy, ReplicationSettings

    replication = ReplicationSettings(kind=args.replicator, kept_fraction=args.compression, values=args.values)
    return FlexDeMoStrategy(settings=FlexDeMoSettings(replication=replication))


def pipeline_settings(args: argparse.Namespace, num_stages: int) -> Any:
    """The pipeline's settings: ``--compress`` at ``d/k = --ssn-compression``, ``--coord-dtype`` boundaries, 1F1B."""
    from lightning_hetero.pipeline.settings import PipelineSettings
    from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings

    return SubspacePipelineSettings(
        pipeline=PipelineSettings(num_stages=num_stages, boundary_dtype=args.coord_dtype),
        schedule="1f1b",
        n_microbatches=args.microbatches,
        compress=args.compress,
        dim_ratio=args.ssn_compression if args.compress else None,
        seed=args.seed,
    )


def lightning_run(args: argparse.Namespace) -> dict[str, Any]:
    """``single``, ``ddp`` or ``flexdemo``; rank 0 evaluates before and after, every rank times its steps."""
    from lightning.pytorch.strategies import DDPStrategy

    world_size, ranks_per_node, rank, data = launch_layout_and_data(args)
    # Constant lr after a 1-step warmup (the cosine's floor at min_lr_ratio=1.0), the same for every strategy.
    module = FinetuneLM(
        args.keep_layers, pretrained=str(args.model_dir), learning_rate=args.learning_rate, warmup_steps=1,
        min_lr_ratio=1.0,
    )  # fmt: skip
    module.configure_model()  # every rank builds it here; the Trainer's call is then a no-op
    module.model.train()  # HF loads models in eval mode
    batches = val_batches(args) if rank == 0 else []
    before = dense_val_loss(module.model, batches) if rank == 0 else None
    if args.strategy == "single":
        strategy: Any = "auto"
    elif args.strategy == "ddp":
        strategy = DDPStrategy()
    else:
        strategy = flexdemo_strategy(args)
    from lightning_hetero.callbacks import ThroughputProgressBar

    clock = StepClock(wire=args.wire_counters)
    # Rank 0's bar (tok/s, s/step, eta from the first step on) goes to the run's log: tail -f it to follow a run.
    bar = [ThroughputProgressBar()] if rank == 0 else []
    trainer = L.Trainer(
        accelerator="cpu", devices=ranks_per_node, num_nodes=world_size // ranks_per_node, strategy=strategy,
        max_steps=args.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=rank == 0, enable_model_summary=False, callbacks=[clock, LossRecorder(clock), *bar],
    )  # fmt: skip
    started = time.perf_counter()
    trainer.fit(module, datamodule=data)
    fit_s = time.perf_counter() - started
    after = dense_val_loss(module.model, batches) if rank == 0 else None
    extra = {"fit_s": fit_s, "val_loss_before": before, "val_loss_after": after, "ledger_label": comm.INTER}
    extra["parameters"] = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    if args.strategy == "flexdemo":
        extra.update(replicator=args.replicator, compression=args.compression, values=args.values)
    return summarize(args, clock.rows, extra)


# ---------------------------------------------------------------------------------------------- pipeline run
def pipeline_run(args: argparse.Namespace) -> dict[str, Any]:
    """One stage of a 2-stage (``WORLD_SIZE``) pipeline over the pretrained weights, plain or subspace."""
    import torch.distributed as dist

    from lightning_hetero.subspace_pipeline.runtime import SubspacePipelineRuntime

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    data = ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size, tokenizer=str(args.model_dir))
    data.setup("fit")
    module = FinetuneLM(args.keep_layers, pretrained=str(args.model_dir), learning_rate=args.learning_rate)
    module.configure_model()
    batches = val_batches(args)
    before = dense_val_loss(module.model, batches) if rank == 0 else None  # the pretrained model, unconverted
    runtime = SubspacePipelineRuntime(pipeline_settings(args, world))
    convert_started = time.perf_counter()
    runtime.setup(module, torch.device("cpu"), rank)
    convert_s = time.perf_counter() - convert_started
    module.train()
    after_conversion = statistics.fmean(float(runtime.eval_step(batch, module)) for batch in batches)
    stage_parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(stage_parameters, lr=args.learning_rate, weight_decay=module.hparams.weight_decay)
    torch.manual_seed(args.seed)  # every stage must iterate the same batches in the same order
    train = iter(data.train_dataloader())
    ledger = comm.get_ledger()
    rows: list[dict[str, float]] = []
    started = time.perf_counter()
    for step in range(args.steps):
        batch = next(train)
        ledger.set_step(step)
        wire_start = read_wire_bytes() if args.wire_counters else None
        dist.barrier()
        begin = time.perf_counter()
        loss = runtime.train_step(batch, module)
        optimizer.step()
        optimizer.zero_grad()
        row = {"step_s": time.perf_counter() - begin, "loss": float(loss)}
        row["ledger_sent"] = ledger.step_totals(step).get(comm.PIPELINE, comm.LedgerTotals()).sent
        wire_end = read_wire_bytes() if args.wire_counters else None
        if wire_start is not None and wire_end is not None:
            row["wire_tx"], row["wire_rx"] = wire_end[0] - wire_start[0], wire_end[1] - wire_start[1]
        rows.append(row)
    fit_s = time.perf_counter() - started
    after = statistics.fmean(float(runtime.eval_step(batch, module)) for batch in batches)
    extra = {
        "fit_s": fit_s,
        "convert_s": convert_s,
        "val_loss_before": before,
        "val_loss_after_conversion": after_conversion,
        "val_loss_after": after,
        "ledger_label": comm.PIPELINE,
        "stage": runtime.stage_index,
        "stage_parameters": sum(p.numel() for p in stage_parameters),
        "microbatches": args.microbatches,
        "compress": args.compress,
        "ssn_compression": args.ssn_compression if args.compress else None,
        "coord_dtype": args.coord_dtype,
    }
    summary = summarize(args, rows, extra)
    dist.barrier()
    dist.destroy_process_group()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["single", "ddp", "flexdemo", "pipeline"], required=True)
    parser.add_argument("--model-dir", type=Path, required=True, help="the prepared SmolLM2 checkpoint (safetensors)")
    parser.add_argument("--out", type=Path, required=True, help="prefix: writes <out>.rank<k>.json")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank (pipeline: per step)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--val-batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-layers", type=int, default=0, help="smoke runs: keep the first N decoder layers")
    parser.add_argument("--replicator", default="demo")
    parser.add_argument("--compression", type=float, default=1 / 32, help="flexdemo: fraction of coefficients kept")
    parser.add_argument("--values", default="sign", help="flexdemo: fp32, bf16, sign or ternary")
    parser.add_argument("--compress", action=argparse.BooleanOptionalAction, default=False, help="pipeline: subspace")
    parser.add_argument("--ssn-compression", type=float, default=16.0, help="pipeline: d / k")
    parser.add_argument("--coord-dtype", default="fp32", help="pipeline: fp32, bf16 or int8 boundaries")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--wire-counters", action="store_true", help="read eth0 counters (only inside the testbed)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # 2 ranks on 2 shared cores: one thread each
    summary = pipeline_run(args) if args.strategy == "pipeline" else lightning_run(args)
    out = Path(f"{args.out}.rank{summary['rank']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
