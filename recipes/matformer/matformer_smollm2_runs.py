"""Distributed runs of ``bench_matformer_smollm2.py``: the fine-tune (lr search, testbed, compute-only) and the table.

Each run starts ``recipes/matformer/matformer_smollm2_worker.py`` on every rank: through ``torchrun`` for ranks on this
machine, through ``python -m lightning_hetero.testbed`` for 2 nodes over a shaped link. Workers write one JSON per
rank; these helpers read them back and summarise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "recipes" / "matformer" / "matformer_smollm2_worker.py"
#: method name -> worker arguments (2 ranks: rank 0 tier 0, rank 1 tier 1 for MatFormer).
METHODS: dict[str, list[str]] = {
    "ddp": ["--strategy", "ddp"],
    "matformer-mean": ["--strategy", "matformer", "--tiers", "0,1", "--mode", "mean", "--eval-tiers", "0,1"],
    "matformer-demo": ["--strategy", "matformer", "--tiers", "0,1", "--mode", "demo", "--eval-tiers", "0,1"],
}
TABLE_MIXES = ["0,0,0,0", "0,0,0,1", "0,0,1,1", "0,1,1,1"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}


def _worker_args(model: Path, out: Path, lr: float, steps: int, val_batches: int, seed: int) -> list[str]:
    return [sys.executable, str(WORKER), "--model-dir", str(model), "--out", str(out), "--learning-rate", str(lr),
            "--steps", str(steps), "--val-batches", str(val_batches), "--seed", str(seed)]  # fmt: skip


def _launch(command: list[str], log: Path, timeout: int) -> float:
    """Run a launcher command, keep its output in ``log``; returns the wall-clock seconds."""
    started = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        completed = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, env=_env(), timeout=timeout)
    if completed.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(command[:6])} ... failed (exit {completed.returncode}); log {log}:\n{tail}")
    return time.perf_counter() - started


def _ranks(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(world)]


def local_run(extra: list[str], nproc: int, out: Path, timeout: int = 3600) -> dict[str, Any]:
    """``torchrun`` with ``nproc`` ranks on this machine."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    wall = _launch(command + extra[1:], out.with_suffix(".log"), timeout)
    return {"wall_s": wall, "ranks": _ranks(out, nproc)}


def testbed_run(extra: list[str], bandwidth: str, out: Path, timeout: int = 3600) -> dict[str, Any]:
    """2 testbed nodes x 1 rank over links shaped to ``bandwidth``."""
    report = Path(f"{out}.testbed.json")
    command = [sys.executable, "-m", "lightning_hetero.testbed", "--nodes", "2", "--ranks-per-node", "1"]
    command += ["--bandwidth", bandwidth, "--report", str(report), "--timeout", str(timeout), "--", *extra]
    wall = _launch(command, out.with_suffix(".log"), timeout + 120)
    return {"wall_s": wall, "ranks": _ranks(out, 2), "testbed": json.loads(report.read_text())}


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of a run: rank 0's losses and bytes, every rank's median compute/sync."""
    ranks = run["ranks"]
    return {
        "wall_s": round(run["wall_s"], 1),
        "fit_s": round(ranks[0]["fit_seconds"], 1),
        "val_loss_before": ranks[0]["val_loss_before"],
        "val_loss_after": ranks[0]["val_loss_after"],
        "per_rank": [
            {
                key: rank.get(key)
                for key in (
                    "tier",
                    "parameters_held",
                    "median_step_s",
                    "median_compute_s",
                    "median_sync_s",
                    "median_ledger_sent_per_step",
                    "median_wire_tx_per_step",
                    "median_wire_rx_per_step",
                )
            }
            for rank in ranks
        ],  # fmt: skip
    }


def run_finetune(work: Path, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """lr search on local ranks, each method's best lr over the testbed, and a compute-only run for R."""
    from lightning_hetero.comm import parse_bandwidth

    bits_per_second = parse_bandwidth(args.bandwidth)
    folder = work / "finetune"
    search: dict[str, dict[str, Any]] = {}
    best_lr: dict[str, float] = {}
    for method in args.methods:
        search[method] = {}
        if len(args.lrs) == 1:  # nothing to search: every method gets the one learning rate
            best_lr[method] = args.lrs[0]
            continue
        for lr in args.lrs:
            out = folder / "search" / f"{method}-lr{lr:g}"
            extra = _worker_args(model, out, lr, args.steps, args.val_batches, args.seed) + METHODS[method]
            search[method][f"{lr:g}"] = _brief(local_run(extra, 2, out))
            print(json.dumps({"search": method, "lr": lr, **search[method][f"{lr:g}"]}), flush=True)
        best_lr[method] = min(args.lrs, key=lambda lr: search[method][f"{lr:g}"]["val_loss_after"]["tier0"])
    testbed: dict[str, Any] = {}
    for method in args.methods:
        out = folder / "testbed" / method
        extra = _worker_args(model, out, best_lr[method], args.steps, args.val_batches, args.seed) + METHODS[method]
        run = testbed_run([*extra, "--wire-counters"], args.bandwidth, out)
        testbed[method] = {"learning_rate": best_lr[method], **_brief(run), "testbed_nodes": run["testbed"]["nodes"]}
        wire = max(testbed[method]["per_rank"][0]["median_wire_tx_per_step"] or 0,
                   testbed[method]["per_rank"][0]["median_wire_rx_per_step"] or 0)  # fmt: skip
        testbed[method]["link_s_per_step"] = wire * 8 / bits_per_second
        print(json.dumps({"testbed": method, **testbed[method]}), flush=True)
    results: dict[str, Any] = {
        "bandwidth": args.bandwidth,
        "bits_per_second": bits_per_second,
        "steps": args.steps,
        "batch": [2, 128],
        "lr_grid": args.lrs,
        "best_lr": best_lr,
        "search": search,
        "testbed": testbed,
    }
    if "ddp" in testbed:  # R: the stock baseline's link time / its compute time (one process, no communication)
        out = folder / "compute-only"
        single = _worker_args(model, out, args.lrs[0], 3, 1, args.seed) + ["--strategy", "single"]
        _launch(single, out.with_suffix(".log"), 3600)
        compute = _ranks(out, 1)[0]
        results["compute_only_step_s"] = compute["median_step_s"]
        results["R"] = testbed["ddp"]["link_s_per_step"] / compute["median_step_s"]
        print(f"R (DDP link time / compute time per step at {args.bandwidth}) = {results['R']:.2f}", flush=True)
    return results


def run_table(work: Path, model: Path, args: argparse.Namespace, lr: float) -> dict[str, Any]:
    """The seed's 4-rank tier-mix table (mean aggregation), short runs from the pretrained weights."""
    rows = []
    for mix in TABLE_MIXES:
        out = work / "table" / f"mean-{mix.replace(',', '')}"
        extra = _worker_args(model, out, lr, args.table_steps, args.val_batches, args.seed)
        extra += ["--strategy", "matformer", "--tiers", mix, "--mode", "mean", "--eval-tiers", "0,1"]
        extra += ["--batch-size", "1"]
        run = local_run(extra, 4, out)
        row = {"tiers": [int(t) for t in mix.split(",")], "mode": "mean", **_brief(run)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"steps": args.table_steps, "learning_rate": lr, "batch": [1, 128], "ranks": 4, "rows": rows}
