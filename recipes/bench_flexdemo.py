"""FlexDeMo vs stock HSDP + AdamW on the bandwidth testbed: inter-node bytes, step time, loss, time to a target loss.

Two nodes x two ranks (network namespaces joined by tc-shaped veth links; root needed), ``llama-tiny`` on
Shakespeare, every variant from the same seed and data (``recipes/bench_worker.py`` does the training):

- ``hsdp``: stock Lightning ``ModelParallelStrategy`` + FSDP2 HSDP + torch AdamW (the testbed baseline);
- ``demo`` and ``random`` replicators at compression 1/16, 1/32, 1/64 with bf16 and sign values (FlexDeMoStrategy;
  the module's AdamW becomes DecoupledAdamW with the same hyperparameters);
- ``diloco`` (H = 32 local steps between syncs).

Two phases, because the loss of a run does not depend on the link (runs are deterministic) but its speed does:

1. quality, unthrottled: ``--steps`` steps, validation every ``--val-every`` steps (rank 0's validation shard);
2. speed, at every throttled ``--bandwidths`` entry: ``--speed-steps`` steps, median step time and the node's wire
   bytes per step (eth0 counters: payload, TCP/IP headers and gloo framing); unthrottled, phase 1's own numbers.

Derived: the target loss is HSDP's final validation loss x ``(1 + --target-margin)``; a variant's time to target is
(first validated step at or under the target) x (its median step time at that bandwidth), validation excluded.

    sudo python recipes/bench_flexdemo.py                 # all variants: ~1.5 hours on 2 CPU cores
    python recipes/bench_flexdemo.py --variants hsdp demo-1/32-bf16 demo-1/32-sign diloco --steps 150
    python recipes/bench_flexdemo.py --plot-only outputs/bench_flexdemo/results.json
    python recipes/bench_flexdemo.py --reanalyse outputs/bench_flexdemo/results.json --target-loss 5.4
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
from lightning_hetero.comm.operating_point import operating_point, physical_limit_ratio
from lightning_hetero.data import ShakespeareDataModule

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
WORKER = REPO / "recipes" / "bench_worker.py"
UNTHROTTLED = "unthrottled"
COMPRESSIONS = {"1/16": 1 / 16, "1/32": 1 / 32, "1/64": 1 / 64}


BASELINES = ("hsdp", "ddp")


def all_variants() -> list[str]:
    """``hsdp``, ``{demo,random}-{1/16,1/32,1/64}-{bf16,sign}``, ``diloco``."""
    sparse = [f"{r}-{c}-{v}" for r in ("demo", "random") for c in COMPRESSIONS for v in ("bf16", "sign")]
    return ["hsdp", *sparse, "diloco"]


def split_learning_rate(variant: str) -> tuple[str, float | None]:
    """``"demo-1/32-bf16@1e-3"`` -> ``("demo-1/32-bf16", 0.001)``; no ``@``: the run's ``--learning-rate``."""
    name, _, rate = variant.partition("@")
    if not rate:
        return name, None
    try:
        return name, float(rate)
    except ValueError:
        raise ValueError(f"variant {variant!r}: the part after '@' must be a learning rate such as 1e-3") from None


def baseline_of(variant: str) -> bool:
    """Whether a variant is a stock baseline (``hsdp`` or ``ddp``, with or without an ``@lr``)."""
    return split_learning_rate(variant)[0] in BASELINES


def worker_args(variant: str) -> list[str]:
    """The worker's strategy arguments for a variant name (``name`` or ``name@learning_rate``)."""
    variant, rate = split_learning_rate(variant)
    if rate is not None:
        return [*worker_args(variant), "--learning-rate", str(rate)]
    if variant in BASELINES:
        return ["--strategy", variant]
    if variant == "diloco":
        return ["--strategy", "flexdemo", "--replicator", "diloco", "--compression", str(1 / 32)]
    replicator, compression, values = variant.split("-")
    if replicator not in ("demo", "random") or compression not in COMPRESSIONS or values not in ("bf16", "sign"):
        raise ValueError(f"unknown variant {variant!r}; choose from {all_variants()}")
    strategy = ["--strategy", "flexdemo", "--replicator", replicator]
    return strategy + ["--compression", str(COMPRESSIONS[compression]), "--values", values]


def run_variant(variant: str, bandwidth: str, steps: int, val_every: int, args: argparse.Namespace) -> dict[str, Any]:
    """One testbed run of ``variant``: the worker's JSON summary plus bandwidth and wall time."""
    tag = f"{variant.replace('/', '_')}-{bandwidth}-{steps}"
    out = args.out_dir / f"{tag}.json"
    worker = [sys.executable, str(WORKER), "--learning-rate", str(args.learning_rate), *worker_args(variant)]
    worker += ["--steps", str(steps), "--out", str(out), "--preset", args.preset]
    worker += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--wire-counters", "--warmup", "2"]
    if val_every:
        worker += ["--val-every", str(val_every), "--val-batches", str(args.val_batches)]
    command = [sys.executable, "-m", "lightning_hetero.testbed", "--nodes", "2"]
    command += ["--ranks-per-node", str(args.ranks_per_node)]
    command += ["--report", str(args.out_dir / f"{tag}-testbed.json"), "--timeout", str(args.timeout)]
    if bandwidth != UNTHROTTLED:
        command += ["--bandwidth", bandwidth]
    started = time.perf_counter()
    completed = subprocess.run([*command, "--", *worker], cwd=args.out_dir, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{tag} failed (exit {completed.returncode}):\n{completed.stdout[-3000:]}{completed.stderr}")
    summary = json.loads(out.read_text())
    summary.update(variant=variant, bandwidth=bandwidth, wall_s=round(time.perf_counter() - started, 1))
    summary.pop("step_seconds", None)
    return summary


def run_compute_only(args: argparse.Namespace) -> dict[str, Any]:
    """One process, one thread (each testbed rank gets one core), no communication: the compute part of a step."""
    out = args.out_dir / "compute-only.json"
    command = [sys.executable, str(WORKER), "--strategy", "single", "--steps", "12", "--out", str(out)]
    command += ["--preset", args.preset, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, env=env, check=True, cwd=args.out_dir, capture_output=True)
    summary = json.loads(out.read_text())
    summary.pop("step_seconds", None)
    return summary


def run_metadata() -> dict[str, Any]:
    """Git revision, library versions and machine of the run."""
    import platform

    import torch
    from headline import git_revision

    return {
        "git_revision": git_revision(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def analyse(
    quality: dict[str, dict],
    speed: dict[str, dict[str, dict]],
    margin: float,
    target_loss: float | None = None,
    compute_s: float | None = None,
) -> dict[str, Any]:
    """Bytes ratios, loss gaps, time to target, R and the physical-limit ratio, relative to the tuned baseline.

    The baseline is the stock variant (``hsdp``/``ddp``, any ``@lr``) with the lowest final validation loss: it gets
    its own learning-rate tuning. The target is ``target_loss`` when given, else the baseline's final validation loss
    x ``(1 + margin)``. ``speed`` is keyed by variant name without ``@lr`` (step time does not depend on the rate).
    ``compute_s`` (one process, no communication) gives R and step / max(compute, wire / bandwidth).
    """
    baselines = [variant for variant in quality if baseline_of(variant)]
    if not baselines:
        raise ValueError(f"no baseline among {list(quality)}: include hsdp or ddp (optionally @lr)")
    best = min(baselines, key=lambda variant: quality[variant]["val_losses"][-1][1])
    base_final = quality[best]["val_losses"][-1][1]
    base_speed = speed[split_learning_rate(best)[0]]
    target = target_loss if target_loss is not None else base_final * (1 + margin)
    rows = {}
    for variant, run in quality.items():
        final = run["val_losses"][-1][1]
        reached = next((step for step, loss in run["val_losses"] if loss <= target), None)
        row: dict[str, Any] = {
            "final_val_loss": round(final, 4),
            "loss_vs_baseline": round(final / base_final - 1, 4),
            "steps_to_target": reached,
        }
        for bandwidth, measured in speed.get(split_learning_rate(variant)[0], {}).items():
            wire = max(measured["wire_tx_bytes_per_step"], measured["wire_rx_bytes_per_step"])
            baseline = base_speed[bandwidth]
            base_wire = max(baseline["wire_tx_bytes_per_step"], baseline["wire_rx_bytes_per_step"])
            row[bandwidth] = {
                "median_step_s": round(measured["median_step_s"], 4),
                "wire_bytes_per_step": wire,
                "bytes_reduction_vs_baseline": round(base_wire / wire, 1) if wire else None,
                "time_to_target_s": round(reached * measured["median_step_s"], 1) if reached else None,
            }
            if compute_s and bandwidth != UNTHROTTLED:
                row[bandwidth]["step_over_physical_limit"] = round(
                    physical_limit_ratio(measured["median_step_s"], compute_s, wire, bandwidth), 2
                )
        rows[variant] = row
    for row in rows.values():
        for bandwidth, cell in row.items():
            if isinstance(cell, dict):
                mine, base_time = cell["time_to_target_s"], rows[best][bandwidth]["time_to_target_s"]
                cell["speedup_to_target"] = round(base_time / mine, 2) if mine and base_time else None
    operating = {}
    if compute_s:
        for bandwidth, measured in base_speed.items():
            if bandwidth != UNTHROTTLED:
                wire = max(measured["wire_tx_bytes_per_step"], measured["wire_rx_bytes_per_step"])
                operating[bandwidth] = operating_point(wire, bandwidth, compute_s).as_dict()
    return {
        "baseline": best,
        "target_val_loss": round(target, 4),
        "compute_s": compute_s,
        "operating_point": operating,
        "variants": rows,
    }


def plot(results: dict[str, Any], directory: Path) -> None:
    """loss_vs_wallclock.png (per bandwidth) and bytes_per_step.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = results["config"]["bandwidths"]
    figure, axes = plt.subplots(1, len(bandwidths), figsize=(5 * len(bandwidths), 4), sharey=True, squeeze=False)
    for axis, bandwidth in zip(axes[0], bandwidths, strict=True):
        for variant, run in results["quality"].items():
            measured = results["speed"].get(split_learning_rate(variant)[0], {}).get(bandwidth)
            if measured is None:
                continue
            steps, losses = zip(*run["val_losses"], strict=True)
            axis.plot([s * measured["median_step_s"] for s in steps], losses, label=variant, linewidth=1)
        axis.set_xscale("log")
        axis.set_title(f"validation loss vs training time @ {bandwidth}")
        axis.set_xlabel("seconds (measured step time x steps)")
    axes[0][0].set_ylabel("validation loss")
    axes[0][0].legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(directory / "loss_vs_wallclock.png", dpi=120)

    figure, axis = plt.subplots(figsize=(9, 4))
    variants = list(results["analysis"]["variants"])
    first = bandwidths[-1]
    values = [results["analysis"]["variants"][v].get(first, {}).get("wire_bytes_per_step") or 0 for v in variants]
    axis.bar(range(len(variants)), values)
    axis.set_yscale("log")
    axis.set_xticks(range(len(variants)), variants, rotation=60, ha="right", fontsize=7)
    axis.set_ylabel(f"wire bytes per step per node @ {first}")
    figure.tight_layout()
    figure.savefig(directory / "bytes_per_step.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=all_variants())
    parser.add_argument("--bandwidths", nargs="+", default=[UNTHROTTLED, "100mbit", "20mbit"])
    parser.add_argument("--steps", type=int, default=300, help="quality phase: optimizer steps")
    parser.add_argument("--val-every", type=int, default=25)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--speed-steps", type=int, default=10, help="speed phase: steps per bandwidth (2 warm-up)")
    parser.add_argument("--slow-link-speed-steps", type=int, default=10, help="speed phase below 50 Mbit")
    parser.add_argument("--preset", default="llama-tiny", help="model preset (llama-medium: the link-bound size)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="2 nodes x this many ranks")
    parser.add_argument("--headline", action="store_true", help="write the flexdemo section of headline.json")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--target-margin", type=float, default=0.02, help="target = HSDP final loss x (1 + margin)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per testbed run")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/bench_flexdemo"))
    parser.add_argument("--target-loss", type=float, help="explicit target validation loss (overrides the margin)")
    parser.add_argument("--plot-only", type=Path, help="re-plot an existing results.json and exit")
    parser.add_argument("--reanalyse", type=Path, help="recompute the analysis of a results.json (new target) and exit")
    args = parser.parse_args()

    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.parent)
        return
    if args.reanalyse:
        results = json.loads(args.reanalyse.read_text())
        compute = results.get("compute_only", {}).get("median_step_s")
        results["analysis"] = analyse(
            results["quality"], results["speed"], args.target_margin, args.target_loss, compute
        )
        args.reanalyse.write_text(json.dumps(results, indent=1))
        print(json.dumps(results["analysis"], indent=1))
        return
    if not any(baseline_of(variant) for variant in args.variants):
        parser.error("--variants must include a stock baseline, hsdp or ddp (optionally @lr, e.g. ddp@1e-3).")
    if args.ranks_per_node == 1 and any(split_learning_rate(v)[0] == "hsdp" for v in args.variants):
        parser.error("hsdp shards within a node: use --ranks-per-node 2 for it, or the ddp baseline.")
    for variant in args.variants:
        worker_args(variant)  # fail on a bad name before any run
    for bandwidth in args.bandwidths:
        if bandwidth != UNTHROTTLED:
            parse_bandwidth(bandwidth)
    args.out_dir = args.out_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size).prepare_data()  # tokenize once

    compute = run_compute_only(args)
    print(f"compute only: {compute['median_step_s']:.3f} s/step", file=sys.stderr, flush=True)
    quality, speed = {}, {}
    for variant in args.variants:
        quality[variant] = run_variant(variant, UNTHROTTLED, args.steps, args.val_every, args)
        print(f"{variant}: val losses {quality[variant]['val_losses'][-3:]}", file=sys.stderr, flush=True)
        name = split_learning_rate(variant)[0]  # step time and bytes do not depend on the learning rate
        for bandwidth in args.bandwidths:
            if bandwidth in speed.get(name, {}):
                continue
            # Unthrottled, the quality run's own step times and wire bytes are the measurement (validation excluded).
            if bandwidth == UNTHROTTLED:
                speed.setdefault(name, {})[bandwidth] = quality[variant]
            else:
                slow = parse_bandwidth(bandwidth) < 50e6  # few steps suffice when each takes tens of seconds
                steps = args.slow_link_speed_steps if slow else args.speed_steps
                speed.setdefault(name, {})[bandwidth] = run_variant(variant, bandwidth, steps, 0, args)
            measured = speed[name][bandwidth]
            print(
                f"{variant} @ {bandwidth}: {measured['median_step_s']:.3f} s/step, wire tx/rx "
                f"{measured['wire_tx_bytes_per_step']:.0f}/{measured['wire_rx_bytes_per_step']:.0f} B/step",
                file=sys.stderr,
                flush=True,
            )
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    results = {"meta": run_metadata(), "config": config, "compute_only": compute, "quality": quality, "speed": speed}
    results["analysis"] = analyse(quality, speed, args.target_margin, args.target_loss, compute["median_step_s"])
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out_dir)
    if args.headline:
        write_headline(results["analysis"])
    print(json.dumps(results["analysis"], indent=1))


def write_headline(analysis: dict[str, Any], bandwidth: str = "100mbit") -> None:
    """The ``flexdemo`` section of docs/results/headline.json: the FlexDeMo variant fastest to target at 100 Mbit."""
    from headline import update_headline

    baseline = analysis["variants"][analysis["baseline"]]
    candidates = {
        name: row
        for name, row in analysis["variants"].items()
        if not baseline_of(name) and row.get(bandwidth, {}).get("speedup_to_target")
    }
    if not candidates:
        update_headline(
            "flexdemo", {"R": analysis["operating_point"].get(bandwidth, {}).get("ratio"), "reached": False}
        )
        return
    best = max(candidates, key=lambda name: candidates[name][bandwidth]["speedup_to_target"])
    row = candidates[best]
    update_headline(
        "flexdemo",
        {
            "R": analysis["operating_point"][bandwidth]["ratio"],
            "baseline": analysis["baseline"],
            "variant": best,
            "speedup_time_to_target_100mbit": row[bandwidth]["speedup_to_target"],
            "val_loss_gap_pct": round(100 * row["loss_vs_baseline"], 2),
            "bytes_ratio": row[bandwidth]["bytes_reduction_vs_baseline"],
            "step_over_physical_limit_100mbit": row[bandwidth].get("step_over_physical_limit"),
            "baseline_final_val_loss": baseline["final_val_loss"],
            "results": "docs/results/bench_flexdemo_linkbound/results.json",
        },
    )


if __name__ == "__main__":
    main()
