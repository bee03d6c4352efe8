"""One rank of a benchmark: stock Lightning DDP, stock FSDP2 HSDP, FlexDeMo, or a single process (compute only).

Run by ``recipes/flexdemo/bench_baselines.py`` and ``recipes/flexdemo/bench_flexdemo.py`` under the bandwidth testbed,
which starts every rank itself with a torchrun-style environment (so Lightning detects torchelastic and does not spawn).
Each step's wall time and the node's veth byte counters (``/sys/class/net/eth0/statistics`` inside the testbed
namespace) are recorded; rank 0 writes a JSON summary to ``--out``.

    python recipes/flexdemo/bench_worker.py --strategy single --steps 12 --out /tmp/single.json

With ``--val-every N`` the validation loss (``--val-batches`` batches of rank 0's validation shard) is recorded every
``N`` steps; validation time is not part of the step times. The FlexDeMo flags (``--replicator``, ``--kept-fraction``,
``--values``, ``--chunk``, ``--sync-every``, ``--outer-lr``, ``--outer-momentum``, ``--outer-kept-fraction``) become the
strategy's ``FlexDeMoSettings.replication`` (``Variant.replication_settings`` in
``recipes/flexdemo/flexdemo_variants.py``); ``--no-error-feedback`` hands the strategy a ``DecoupledAdamW`` whose
replicator drops what it does not send (``recipes/flexdemo/flexdemo_variants.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from flexdemo_variants import Variant, build_variant_replicator
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from typing_extensions import override

from lightning_hetero.data import ShakespeareDataModule
from lightning_hetero.models import CausalLMModule

COUNTERS = Path("/sys/class/net/eth0/statistics")


def read_wire_bytes() -> tuple[int, int] | None:
    """(tx, rx) bytes of this namespace's eth0, or None outside the testbed."""
    try:
        return int((COUNTERS / "tx_bytes").read_text()), int((COUNTERS / "rx_bytes").read_text())
    except OSError:
        return None


class StepRecorder(L.Callback):
    """Wall time and node wire bytes of every training step (forward, backward with its sync, optimizer step)."""

    def __init__(self, read_wire: bool) -> None:
        self.read_wire = read_wire
        self.step_seconds: list[float] = []
        self.step_wire: list[tuple[int, int]] = []
        self.codec_seconds: list[float] = []  # FlexDeMo: the replicator's encode + decode time in each step
        self.wait_seconds: list[float] = []  # FlexDeMo: time blocked on the exchange in each step
        self._start = 0.0
        self._wire_start: tuple[int, int] | None = None

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._wire_start = read_wire_bytes() if self.read_wire else None
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.step_seconds.append(time.perf_counter() - self._start)
        wire_end = read_wire_bytes() if self.read_wire else None
        if wire_end is not None and self._wire_start is not None:
            self.step_wire.append((wire_end[0] - self._wire_start[0], wire_end[1] - self._wire_start[1]))
        optimizer = getattr(getattr(trainer.strategy, "runtime", None), "optimizer", None)
        stats = optimizer.comm_stats() if hasattr(optimizer, "comm_stats") else {}
        if "encode_seconds" in stats:
            self.codec_seconds.append(stats["encode_seconds"] + stats["decode_seconds"])
            self.wait_seconds.append(stats["wait_seconds"])


class ValidationRecorder(L.Callback):
    """``(global step, val/loss)`` after every validation run."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None and not trainer.sanity_checking:
            self.losses.append((trainer.global_step, float(loss)))


class HSDPCausalLM(CausalLMModule):
    """The reference causal LM with FSDP2 ``fully_shard`` on the strategy's 2-D mesh (replicate x shard = HSDP)."""

    @override
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        super().configure_model()
        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh  # (data_parallel = nodes, tensor_parallel = ranks per node), used as (replicate, shard)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class OwnReplicatorCausalLM(CausalLMModule):
    """The reference causal LM whose AdamW is converted here, with a replicator the strategy cannot build by name.

    ``configure_optimizers`` runs after the strategy has sharded the model; converting the AdamW with the same
    ``convert_optimizer`` the strategy uses (and re-pointing the LR scheduler) hands it a ``DecoupledAdamW`` it uses
    as given, identical to the stock conversion except for the replicator.
    """

    replicator_factory: Callable[[], Any] | None = None
    use_sgd: bool = False
    adamw_exchange: str = "direction"

    @override
    def configure_optimizers(self) -> Any:
        from lightning_hetero.flexdemo.conversion import convert_optimizer, repoint_scheduler

        config = super().configure_optimizers()
        if self.use_sgd:  # same groups, lr and schedule; the strategy converts SGD to DeMoSGD (momentum 0.999, sign)
            adamw = config["optimizer"]
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in adamw.param_groups]
            config["optimizer"] = torch.optim.SGD(groups, lr=adamw.defaults["lr"])
            repoint_scheduler(config["lr_scheduler"]["scheduler"], adamw, config["optimizer"])
        if self.replicator_factory is None:
            return config
        original = config["optimizer"]
        config["optimizer"], _ = convert_optimizer(
            original, self.replicator_factory, adamw_exchange=self.adamw_exchange, preconditioner_beta2=None
        )  # the recorded sweeps ran with the module's own beta2
        repoint_scheduler(config["lr_scheduler"]["scheduler"], original, config["optimizer"])
        return config


class HSDPStrategy(ModelParallelStrategy):
    """Stock ``ModelParallelStrategy`` whose sampler treats every rank as data parallel.

    The stock strategy shards data over the first mesh dimension only (it assumes the second is tensor parallel), so
    the ranks of one node would see the same batch; with HSDP every rank is a data-parallel replica.
    """

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["single", "ddp", "hsdp", "flexdemo"], required=True)
    parser.add_argument("--replicator", default="demo", help="flexdemo: demo, random, striding, diloco, full, topk")
    parser.add_argument("--kept-fraction", type=float, default=1 / 32, help="flexdemo: fraction of coefficients kept")
    parser.add_argument("--values", default=None, help="flexdemo: fp32, bf16, sign or ternary (replicator default)")
    parser.add_argument("--chunk", type=int, default=None, help="flexdemo demo/topk: block side (default 64)")
    parser.add_argument("--sync-every", type=int, default=None, help="flexdemo diloco: H (default 1/kept_fraction)")
    parser.add_argument("--outer-lr", type=float, default=None, help="flexdemo diloco: outer learning rate (0.7)")
    parser.add_argument("--outer-momentum", type=float, default=None, help="flexdemo diloco: outer momentum (0.9)")
    parser.add_argument(
        "--outer-kept-fraction", type=float, default=None, help="flexdemo diloco: DeMo + DiLoCo delta fraction (None)"
    )
    parser.add_argument("--no-error-feedback", action="store_true", help="flexdemo: drop what is not sent")
    parser.add_argument(
        "--optimizer", choices=["adamw", "sgd"], default="adamw", help="flexdemo: the module's optimizer (sgd: DeMoSGD)"
    )
    parser.add_argument(
        "--adamw-exchange",
        choices=["direction", "preconditioned", "gradient"],
        default="direction",
        help="flexdemo: what a converted AdamW sends (FlexDeMoSettings.adamw_exchange)",
    )
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument(
        "--beta2", type=float, default=None, help="AdamW's beta2 with beta1 0.9 (default: the module's (0.9, 0.95))"
    )
    parser.add_argument("--lr-warmup", type=int, default=0, help="linear warmup steps before the cosine decay")
    parser.add_argument("--seed", type=int, default=0, help="model initialization seed (the data order is fixed)")
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: never)")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the statistics")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--wire-counters", action="store_true", help="read eth0 counters (only inside the testbed)")
    args = parser.parse_args()

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    num_nodes = world_size // ranks_per_node
    L.seed_everything(args.seed, verbose=False)
    data = ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size)
    options = {"preset": args.preset, "warmup_steps": args.lr_warmup, "learning_rate": args.learning_rate}
    if args.beta2 is not None:
        options["betas"] = (0.9, args.beta2)  # the module's beta1
    variant: Variant | None = None
    if args.strategy == "single":
        module, strategy = CausalLMModule(**options), "auto"
    elif args.strategy == "ddp":
        module, strategy = CausalLMModule(**options), DDPStrategy()
    elif args.strategy == "flexdemo":
        from lightning_hetero import FlexDeMoSettings, FlexDeMoStrategy

        variant = Variant(
            name="worker",
            strategy="flexdemo",
            replicator=args.replicator,
            kept_fraction=args.kept_fraction,
            values=args.values,
            chunk=args.chunk,
            error_feedback=not args.no_error_feedback,
            sync_every=args.sync_every,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            outer_kept_fraction=args.outer_kept_fraction,
            adamw_exchange=args.adamw_exchange,
        )
        module = OwnReplicatorCausalLM(**options)  # its AdamW becomes DecoupledAdamW with the same hyperparameters
        module.use_sgd = args.optimizer == "sgd"  # then its SGD becomes DeMoSGD (DeMo's optimizer)
        if not variant.error_feedback:
            module.replicator_factory = lambda: build_variant_replicator(variant)
        module.adamw_exchange = args.adamw_exchange
        strategy = FlexDeMoStrategy(
            # preconditioner_beta2=None: the module's beta2 (--beta2, the variant's b token) is what runs, so a
            # variant name means the same optimizer whatever the strategy's default.
            settings=FlexDeMoSettings(
                replication=variant.replication_settings(),
                adamw_exchange=args.adamw_exchange,
                preconditioner_beta2=None,
            )
        )
    else:
        module = HSDPCausalLM(**options)
        strategy = HSDPStrategy(data_parallel_size=num_nodes, tensor_parallel_size=ranks_per_node)
    recorder = StepRecorder(read_wire=args.wire_counters)
    validation = ValidationRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ranks_per_node,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=args.val_batches if args.val_every else 0,
        val_check_interval=args.val_every or None,
        check_val_every_n_epoch=None if args.val_every else 1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, validation],
    )
    trainer.fit(module, datamodule=data)
    if trainer.global_rank != 0:
        return
    measured = recorder.step_seconds[args.warmup :]
    wire = recorder.step_wire[args.warmup :]
    codec, waits = recorder.codec_seconds[args.warmup :], recorder.wait_seconds[args.warmup :]
    median_step = statistics.median(measured)
    tokens_per_step = args.batch_size * args.seq_len * world_size
    summary = {
        "strategy": args.strategy,
        "preset": args.preset,
        "parameters": sum(p.numel() for p in module.parameters()),
        "world_size": world_size,
        "nodes": num_nodes,
        "ranks_per_node": ranks_per_node,
        "batch_size_per_rank": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "lr_warmup": args.lr_warmup,
        "learning_rate": args.learning_rate,
        "torch_threads": torch.get_num_threads(),
        "step_seconds": recorder.step_seconds,
        "median_step_s": median_step,
        "mean_step_s": statistics.fmean(measured),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / median_step,
        # This node's eth0 during the measured steps: (tx, rx) bytes per step; None outside the testbed.
        "wire_tx_bytes_per_step": statistics.median(tx for tx, _ in wire) if wire else None,
        "wire_rx_bytes_per_step": statistics.median(rx for _, rx in wire) if wire else None,
        # Means: periodic exchanges (DiLoCo) send on some steps only; over a whole period the mean is the cost.
        "wire_tx_bytes_per_step_mean": statistics.fmean(tx for tx, _ in wire) if wire else None,
        "wire_rx_bytes_per_step_mean": statistics.fmean(rx for _, rx in wire) if wire else None,
        # FlexDeMo only (None otherwise): the replicator's compute (transform, top-k, packing) and the time blocked on
        # the exchange, per measured step; medians, and means for periodic exchanges.
        "median_codec_s": statistics.median(codec) if codec else None,
        "mean_codec_s": statistics.fmean(codec) if codec else None,
        "median_wait_s": statistics.median(waits) if waits else None,
        "mean_wait_s": statistics.fmean(waits) if waits else None,
        "val_losses": validation.losses,
        "replicator": args.replicator if args.strategy == "flexdemo" else None,
        "kept_fraction": args.kept_fraction if args.strategy == "flexdemo" else None,
        "values": args.values if args.strategy == "flexdemo" else None,
        "replicator_options": variant.replicator_options() if variant else None,
        "error_feedback": variant.error_feedback if variant else None,
        "optimizer": args.optimizer if args.strategy == "flexdemo" else "adamw",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
