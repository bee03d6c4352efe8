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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_hetero.comm import parse_bandwidth
from lightning_hetero.data import ShakespeareDataModule

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "recipes" / "bench_worker.py"
UNTHROTTLED = "unthrottled"
COMPRESSIONS = {"1/16": 1 / 16, "1/32": 1 / 32, "1/64": 1 / 64}


def all_variants() -> list[str]:
    """``hsdp``, ``{demo,random}-{1/16,1/32,1/64}-{bf16,sign}``, ``diloco``."""
    sparse = [f"{r}-{c}-{v}" for r in ("demo", "random") for c in COMPRESSIONS for v in ("bf16", "sign")]
    return ["hsdp", *sparse, "diloco"]


def worker_args(variant: str) -> list[str]:
    """The worker's strategy arguments for a variant name."""
    if variant == "hsdp":
        return ["--strategy", "hsdp"]
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
    worker = [sys.executable, str(WORKER), *worker_args(variant), "--steps", str(steps), "--out", str(out)]
    worker += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--wire-counters"]
    worker += ["--learning-rate", str(args.learning_rate), "--warmup", "2"]
    if val_every:
        worker += ["--val-every", str(val_every), "--val-batches", str(args.val_batches)]
    command = [sys.executable, "-m", "lightning_hetero.testbed", "--nodes", "2", "--ranks-per-node", "2"]
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


def analyse(
    quality: dict[str, dict], speed: dict[str, dict[str, dict]], margin: float, target_loss: float | None = None
) -> dict[str, Any]:
    """Bytes ratios, loss gaps and time to target for every variant, relative to ``hsdp``.

    The target is ``target_loss`` when given, else HSDP's final validation loss x ``(1 + margin)``.
    """
    base = quality["hsdp"]
    target = target_loss if target_loss is not None else base["val_losses"][-1][1] * (1 + margin)
    rows = {}
    for variant, run in quality.items():
        final = run["val_losses"][-1][1]
        reached = next((step for step, loss in run["val_losses"] if loss <= target), None)
        row: dict[str, Any] = {
            "final_val_loss": round(final, 4),
            "loss_vs_hsdp": round(final / base["val_losses"][-1][1] - 1, 4),
            "steps_to_target": reached,
        }
        for bandwidth, measured in speed.get(variant, {}).items():
            wire = max(measured["wire_tx_bytes_per_step"], measured["wire_rx_bytes_per_step"])
            baseline = speed["hsdp"][bandwidth]
            base_wire = max(baseline["wire_tx_bytes_per_step"], baseline["wire_rx_bytes_per_step"])
            row[bandwidth] = {
                "median_step_s": round(measured["median_step_s"], 4),
                "wire_bytes_per_step": wire,
                "bytes_reduction_vs_hsdp": round(base_wire / wire, 1) if wire else None,
                "time_to_target_s": round(reached * measured["median_step_s"], 1) if reached else None,
            }
        rows[variant] = row
    for variant, row in rows.items():
        for bandwidth in speed.get(variant, {}):
            mine, base_time = row[bandwidth]["time_to_target_s"], rows["hsdp"][bandwidth]["time_to_target_s"]
            row[bandwidth]["speedup_to_target"] = round(base_time / mine, 2) if mine and base_time else None
    return {"target_val_loss": round(target, 4), "variants": rows}


def plot(results: dict[str, Any], directory: Path) -> None:
    """loss_vs_wallclock.png (per bandwidth) and bytes_per_step.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = results["config"]["bandwidths"]
    figure, axes = plt.subplots(1, len(bandwidths), figsize=(5 * len(bandwidths), 4), sharey=True, squeeze=False)
    for axis, bandwidth in zip(axes[0], bandwidths, strict=True):
        for variant, run in results["quality"].items():
            measured = results["speed"].get(variant, {}).get(bandwidth)
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
        results["analysis"] = analyse(results["quality"], results["speed"], args.target_margin, args.target_loss)
        args.reanalyse.write_text(json.dumps(results, indent=1))
        print(json.dumps(results["analysis"], indent=1))
        return
    if "hsdp" not in args.variants:
        parser.error("--variants must include hsdp (the baseline every ratio is taken against).")
    for variant in args.variants:
        worker_args(variant)  # fail on a bad name before any run
    for bandwidth in args.bandwidths:
        if bandwidth != UNTHROTTLED:
            parse_bandwidth(bandwidth)
    args.out_dir = args.out_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size).prepare_data()  # tokenize once

    quality, speed = {}, {}
    for variant in args.variants:
        quality[variant] = run_variant(variant, UNTHROTTLED, args.steps, args.val_every, args)
        print(f"{variant}: val losses {quality[variant]['val_losses'][-3:]}", file=sys.stderr, flush=True)
        for bandwidth in args.bandwidths:
            # Unthrottled, the quality run's own step times and wire bytes are the measurement (validation excluded).
            run = quality[variant] if bandwidth == UNTHROTTLED else None
            speed.setdefault(variant, {})[bandwidth] = run or run_variant(variant, bandwidth, args.speed_steps, 0, args)
            measured = speed[variant][bandwidth]
            print(
                f"{variant} @ {bandwidth}: {measured['median_step_s']:.3f} s/step, wire tx/rx "
                f"{measured['wire_tx_bytes_per_step']:.0f}/{measured['wire_rx_bytes_per_step']:.0f} B/step",
                file=sys.stderr,
                flush=True,
            )
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    results = {"config": config, "quality": quality, "speed": speed}
    results["analysis"] = analyse(quality, speed, args.target_margin, args.target_loss)
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out_dir)
    print(json.dumps(results["analysis"], indent=1))


if __name__ == "__main__":
    main()
