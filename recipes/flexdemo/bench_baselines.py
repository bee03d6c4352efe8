"""Baselines over throttled links: stock Lightning DDP and stock FSDP2 HSDP, plus compute-only step time.

Every distributed run goes through the bandwidth testbed (``python -m lightning_hetero.testbed``, root needed): two
"nodes" (network namespaces) joined by veth links shaped with tc at each bandwidth. The workers
(``recipes/flexdemo/bench_worker.py``) train ``llama-tiny`` on Shakespeare and record each step's wall time and the
node's inter-node wire bytes. Prints one JSON document and writes ``results.json`` and ``step_time_vs_bandwidth.png``.

    python recipes/flexdemo/bench_baselines.py                       # ~5 minutes on 2 cores
    python recipes/flexdemo/bench_baselines.py --plot-only outputs/bench_baselines/results.json
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

from lightning_hetero.comm import parse_bandwidth
from lightning_hetero.data import ShakespeareDataModule

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "recipes" / "flexdemo" / "bench_worker.py"
UNTHROTTLED = "unthrottled"
#: Strategy -> ranks per node (2 nodes each): DDP 2 x 1, HSDP 2 x 2.
RANKS_PER_NODE = {"ddp": 1, "hsdp": 2}
#: A run is communication-bound when its step time is within this fraction of bytes / bandwidth.
COMM_BOUND_TOLERANCE = 0.25


def worker_command(strategy: str, out: Path, args: argparse.Namespace, wire: bool) -> list[str]:
    command = [sys.executable, str(WORKER), "--strategy", strategy, "--preset", args.preset, "--steps", str(args.steps)]
    command += ["--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    return command + ["--out", str(out)] + (["--wire-counters"] if wire else [])


def run_compute_only(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """One process, no communication, one thread per rank as under the testbed: the physical limit."""
    out = out_dir / "single.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(worker_command("single", out, args, wire=False), env=env, check=True, cwd=out_dir)
    return json.loads(out.read_text())


def run_under_testbed(strategy: str, bandwidth: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """One distributed run through the testbed; returns the worker summary plus the testbed report's totals."""
    tag = f"{strategy}-{bandwidth}"
    out, report_path = out_dir / f"{tag}.json", out_dir / f"{tag}-testbed.json"
    command = [sys.executable, "-m", "lightning_hetero.testbed", "--nodes", "2"]
    command += ["--ranks-per-node", str(RANKS_PER_NODE[strategy]), "--report", str(report_path)]
    command += ["--timeout", str(args.timeout)]
    if bandwidth != UNTHROTTLED:
        command += ["--bandwidth", bandwidth]
    command += ["--", *worker_command(strategy, out, args, wire=True)]
    start = time.perf_counter()
    completed = subprocess.run(command, cwd=out_dir, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{tag} failed (exit {completed.returncode}):\n{completed.stdout[-3000:]}{completed.stderr}")
    summary = json.loads(out.read_text())
    report = json.loads(report_path.read_text())
    summary.update(bandwidth=bandwidth, wall_s=time.perf_counter() - start, testbed_nodes=report.get("nodes"))
    summary["bits_per_second"] = None if bandwidth == UNTHROTTLED else parse_bandwidth(bandwidth)
    if summary["bits_per_second"]:
        busiest = max(summary["wire_tx_bytes_per_step"], summary["wire_rx_bytes_per_step"])
        summary["wire_seconds_per_step"] = busiest * 8 / summary["bits_per_second"]
        summary["step_over_wire_time"] = summary["median_step_s"] / summary["wire_seconds_per_step"]
    return summary


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    runs = results["runs"]
    for strategy in sorted({run["strategy"] for run in runs}):
        throttled = sorted(
            (run for run in runs if run["strategy"] == strategy and run["bits_per_second"]),
            key=lambda run: run["bits_per_second"],
        )
        xs = [run["bits_per_second"] / 1e6 for run in throttled]
        axis.plot(xs, [run["median_step_s"] for run in throttled], "o-", label=f"{strategy} (measured)")
        axis.plot(xs, [run["wire_seconds_per_step"] for run in throttled], "x--", label=f"{strategy} wire bytes / bw")
        for run in runs:
            if run["strategy"] == strategy and not run["bits_per_second"]:
                axis.axhline(run["median_step_s"], linestyle=":", color=axis.lines[-2].get_color(), linewidth=1)
    axis.axhline(results["compute_only"]["median_step_s"], color="black", linewidth=1, label="compute only (1 proc)")
    if any(run["bits_per_second"] for run in runs):  # an unthrottled-only run has no bandwidth axis to log-scale
        axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("inter-node bandwidth (Mbit/s); dotted: unthrottled")
    axis.set_ylabel("median step time (s)")
    axis.set_title(f"{results['config']['preset']}: step time vs inter-node bandwidth (2 nodes)")
    axis.legend(fontsize=8)
    axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", nargs="+", default=[UNTHROTTLED, "1gbit", "100mbit", "20mbit"])
    parser.add_argument("--strategies", nargs="+", choices=sorted(RANKS_PER_NODE), default=["ddp", "hsdp"])
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per testbed run")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/bench_baselines"))
    parser.add_argument("--plot-only", type=Path, help="re-plot an existing results.json and exit")
    args = parser.parse_args()

    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_name("step_time_vs_bandwidth.png"))
        return
    for bandwidth in args.bandwidths:
        if bandwidth != UNTHROTTLED:
            parse_bandwidth(bandwidth)  # fail before any run on a bad rate string
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size).prepare_data()  # tokenize once

    results: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    results["config"]["preset"] = args.preset
    results["compute_only"] = run_compute_only(args, out_dir)
    for strategy in args.strategies:
        for bandwidth in args.bandwidths:
            run = run_under_testbed(strategy, bandwidth, args, out_dir)
            results["runs"].append(run)
            print(
                f"{strategy:>5} @ {bandwidth:>11}: median step {run['median_step_s']:.3f} s, "
                f"{run['tokens_per_s']:.0f} tok/s, wire tx/rx per step {run['wire_tx_bytes_per_step']:.0f}/"
                f"{run['wire_rx_bytes_per_step']:.0f} B",
                file=sys.stderr,
            )
    results["checks"] = {
        run["strategy"] + "@" + run["bandwidth"]: {
            "step_over_wire_time": run["step_over_wire_time"],
            "communication_bound": abs(run["step_over_wire_time"] - 1.0) <= COMM_BOUND_TOLERANCE,
        }
        for run in results["runs"]
        if run.get("step_over_wire_time") is not None and run["bandwidth"] == "20mbit"
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out_dir / "step_time_vs_bandwidth.png")
    brief = {key: value for key, value in results.items() if key != "runs"}
    print(json.dumps(brief | {"runs": [_brief(run) for run in results["runs"]]}))


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("strategy", "bandwidth", "median_step_s", "tokens_per_s", "wire_tx_bytes_per_step", "step_over_wire_time")
    return {key: run.get(key) for key in keys}


if __name__ == "__main__":
    main()
