"""One rank of a torchrun job for tests/dist/test_faults.py: a tiny model trained by one of our strategies,
checkpointed every ``--every`` steps (:class:`~lightning_hetero.callbacks.VerifiedCheckpoint`), resumed from the
newest good checkpoint (:func:`~lightning_hetero.reliability.latest_good_checkpoint`) on every (re)start, with the
fault of ``LIGHTNING_HETERO_FAULT`` (:class:`~lightning_hetero.reliability.FaultPlan`) fired once per job.

Model and data are :mod:`lightning_hetero.testing.resume`'s (a seeded, resumable ``StatefulDataLoader``: a resumed
job trains the batches an uninterrupted one does). Rank 0 appends one line per attempt to ``<out>/attempts.jsonl``
(``attempt``, ``resumed_from``); a failing rank writes ``<out>/error_rank<r>_attempt<a>.json`` (its error and the
explanation); every rank writes its final parameters (local shards where sharded) to ``<out>/final_rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_hetero.callbacks import VerifiedCheckpoint
from lightning_hetero.reliability import FaultPlan, explain_collective_error, latest_good_checkpoint
from lightning_hetero.testing.resume import CASES, ResumeData, ResumeModule

RESUME_CASE = {
    "flexdemo": "flexdemo/demo",
    "matformer": "matformer/mixed-tiers",
    "subspace": "subspace/pipeline",
    "sparseflip": "sparseflip/low-bit",
}
"""Strategy name -> the :data:`~lightning_hetero.testing.resume.CASES` entry whose model and data it trains."""


def _strategy(name: str, timeout: timedelta) -> Any:
    """The strategy ``name`` with a process-group timeout of ``timeout`` seconds (a hung peer fails within it)."""
    common = {"timeout": timeout}
    if name == "flexdemo":
        from lightning_hetero import FlexDeMoStrategy

        return FlexDeMoStrategy(**common)
    if name == "matformer":
        from lightning_hetero import MatFormerStrategy

        return MatFormerStrategy(**common)
    if name == "subspace":
        from lightning_hetero import SubspacePipelineSettings, SubspacePipelineStrategy
        from lightning_hetero.pipeline.settings import PipelineSettings

        settings = SubspacePipelineSettings(pipeline=PipelineSettings(num_stages=2), subspace_dim=8, n_microbatches=2)
        return SubspacePipelineStrategy(settings=settings, **common)
    from lightning_hetero import SparseFlipSettings, SparseFlipStrategy
    from lightning_hetero.sparseflip.settings import FlipSettings

    return SparseFlipStrategy(settings=SparseFlipSettings(flip=FlipSettings(max_per_step=16, bop_gamma=0.3)), **common)


class _FaultsAndRecords(L.Callback):
    """Fires the planned fault once per job; records the attempts, a rank's error and the final parameters."""

    def __init__(self, out: Path, checkpoints: Path, resumed_from: Path | None, timeout: timedelta) -> None:
        self.out, self.checkpoints, self.resumed_from, self.timeout = out, checkpoints, resumed_from, timeout
        plan = FaultPlan.from_env()
        # Once per job: the marker file below, not the attempt (each node's agent counts its own restarts).
        self.plan = None if plan is None else FaultPlan(plan.kind, plan.rank, plan.step, attempt=None)
        attempts = out / "attempts.jsonl"
        self.attempt = len(attempts.read_text().splitlines()) if attempts.is_file() else 0

    def _fire(self, kind: str, trainer: L.Trainer) -> None:
        marker = self.out / "fault.json"
        if (
            self.plan is not None
            and not marker.exists()
            and self.plan.applies(kind, trainer.global_rank, trainer.global_step)
        ):
            marker.write_text(json.dumps({"kind": kind, "rank": trainer.global_rank, "step": trainer.global_step}))
            self.plan.maybe_fire(kind, trainer.global_rank, trainer.global_step, self.checkpoints)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            record = {"attempt": self.attempt, "resumed_from": self.resumed_from.name if self.resumed_from else None}
            with (self.out / "attempts.jsonl").open("a") as stream:
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
        error = f"{type(exception).__name__}: {exception}"[:2000]
        explanation = explain_collective_error(exception, self.timeout)
        name = f"error_rank{trainer.global_rank}_attempt{self.attempt}.json"
        (self.out / name).write_text(json.dumps({"error": error, "explanation": explanation}, indent=1))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = {}
        for name, value in pl_module.named_parameters():
            local = value.to_local() if hasattr(value, "to_local") else value
            params[name] = local.detach().cpu().clone()
        torch.save(params, self.out / f"final_rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=sorted(RESUME_CASE), required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True, help="checkpoint every N steps (0: never)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, required=True, help="process-group timeout, seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    checkpoints = args.out / "checkpoints"
    resume = latest_good_checkpoint(checkpoints) if args.every else None
    timeout = timedelta(seconds=args.timeout)
    callbacks: list[L.Callback] = [_FaultsAndRecords(args.out, checkpoints, resume, timeout)]
    if args.every:
        callbacks.append(VerifiedCheckpoint(dirpath=checkpoints, every_n_train_steps=args.every))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    case = RESUME_CASE[args.strategy]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
        strategy=_strategy(args.strategy, timeout),
        max_steps=args.max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(args.every),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(ResumeModule(CASES[case]["model"]), ResumeData(case, args.max_steps), ckpt_path=resume)


if __name__ == "__main__":
    main()
