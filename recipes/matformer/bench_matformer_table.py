"""The Psyche seed's heterogeneous-tier table on Shakespeare: 4 ranks, tier mixes x aggregation modes.

Every run is ``lightning-hetero fit`` on ``configs/matformer_llama_shakespeare.yaml`` with 4 CPU ranks, the same seed,
data, steps and learning-rate schedule; only the per-rank tiers and the aggregation change:

- tier mixes (0,0,0,0), (0,0,0,1), (0,0,1,1), (0,1,1,1) (rank 0 must be tier 0: it holds the full model);
- ``mean`` (per-region mean over the ranks that trained it), ``sign`` (per-region majority vote) and
  ``sign + tier weights`` (each tier's ranks weighted ``1 / (number of ranks at that tier)``, so every tier counts the
  same in a region whatever its head count: the remedy for the seed's "minority tax").

Reported per run: the lowest validation loss of tier 0 and tier 1 (``TierEvaluation`` on rank 0's validation shard),
wall-clock seconds and FFN-gradient bytes per step of rank 0 and of the last rank (``CommunicationMonitor``).
Seed reference (20M NanoGPT, sign): tier-0 3.764 / 3.758 / 3.779 / 3.861, tier-1 - / 3.837 / 3.863 / 3.787.

    python recipes/matformer/bench_matformer_table.py                  # 12 runs x 300 steps: ~40 minutes on 2 CPU cores
    python recipes/matformer/bench_matformer_table.py --steps 20 --mixes 0,0,0,1 --modes mean   # smoke run
    python recipes/matformer/bench_matformer_table.py --plot               # also writes table.png next to results.json
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
BASE_CONFIG = ROOT / "configs" / "matformer_llama_shakespeare.yaml"
DEFAULT_MIXES = ["0,0,0,0", "0,0,0,1", "0,0,1,1", "0,1,1,1"]
MODES = {
    "mean": {"mode": "mean", "weighted": False},
    "sign": {"mode": "sign", "weighted": False},
    "sign+weights": {"mode": "sign", "weighted": True},
}


def balanced_tier_weights(tiers: list[int]) -> list[float]:
    """Weight of each tier index: ``1 / (ranks at that tier)`` (1.0 for tiers nobody runs)."""
    return [1.0 / tiers.count(t) if t in tiers else 1.0 for t in range(max(tiers) + 1)]


def run_config(tiers: list[int], mode: str, steps: int, out: Path, val_every: int) -> dict[str, Any]:
    """Write the YAML of one run, run it with 4 (= len(tiers)) ranks and return its summary."""
    spec = MODES[mode]
    config = yaml.safe_load(BASE_CONFIG.read_text())
    trainer = config["trainer"]
    trainer.update(
        devices=len(tiers),
        max_steps=steps,
        val_check_interval=min(val_every, steps),
        default_root_dir=str(out),
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer["logger"]["init_args"]["save_dir"] = str(out)
    settings = trainer["strategy"]["init_args"]["settings"]
    weights = balanced_tier_weights(tiers) if spec["weighted"] else None
    settings.update(tiers=tiers, mode=spec["mode"], tier_weights=weights)
    trainer["callbacks"] = [cb for cb in trainer["callbacks"] if not cb["class_path"].endswith("TierExport")]
    # Evaluate both tiers even in the all-tier-0 run (tier 1 there is the untrained-for slice: reported, not compared).
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("TierEvaluation"):
            callback.setdefault("init_args", {})["tiers"] = [0, 1]
    config["model"]["init_args"]["warmup_steps"] = max(1, steps // 12)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "lightning_hetero", "fit", "--config", str(config_path)],
        cwd=out,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    seconds = time.perf_counter() - started
    (out / "log.txt").write_text(completed.stdout + completed.stderr)
    if completed.returncode != 0:
        raise RuntimeError(f"run {tiers} {mode} failed (exit {completed.returncode}); see {out / 'log.txt'}")
    return {"tiers": tiers, "mode": mode, "seconds": round(seconds, 1), **_read_metrics(out)}


def _read_metrics(out: Path) -> dict[str, Any]:
    files = sorted(out.glob("logs/version_*/metrics.csv"))
    if not files:
        raise FileNotFoundError(f"no metrics.csv under {out}/logs")
    rows = list(csv.DictReader(files[-1].open()))

    def column(name: str) -> list[float]:
        return [float(row[name]) for row in rows if row.get(name) not in (None, "")]

    summary: dict[str, Any] = {}
    for tier in (0, 1):
        values = column(f"val/loss_tier{tier}")
        summary[f"best_val_loss_tier{tier}"] = round(min(values), 4) if values else None
        summary[f"final_val_loss_tier{tier}"] = round(values[-1], 4) if values else None
    sent = column("comm/inter/bytes_sent_step")
    summary["rank0_inter_bytes_per_step"] = int(sent[-1]) if sent else None
    return summary


def plot(results: dict[str, Any], path: Path) -> None:
    """Best tier-0 / tier-1 validation loss per tier mix, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for index, tier in enumerate((0, 1)):
        for mode in results["modes"]:
            rows = [row for row in results["runs"] if row["mode"] == mode]
            labels = ["".join(map(str, row["tiers"])) for row in rows]
            values = [row[f"best_val_loss_tier{tier}"] or math.nan for row in rows]
            axes[index].plot(labels, values, marker="o", label=mode)
        axes[index].set_title(f"tier {tier}: best validation loss")
        axes[index].set_xlabel("tiers of ranks 0..3")
    axes[0].set_ylabel("validation loss")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", nargs="+", default=DEFAULT_MIXES, help="comma-separated tiers per rank")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--val-every", type=int, default=50, help="validate every this many steps")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_matformer_table"))
    parser.add_argument("--plot", action="store_true", help="write table.png (needs matplotlib)")
    args = parser.parse_args()

    mixes = [[int(t) for t in mix.split(",")] for mix in args.mixes]
    for tiers in mixes:
        if tiers[0] != 0:
            parser.error(f"--mixes {','.join(map(str, tiers))}: rank 0 must be tier 0 (it holds the full model).")
    runs = []
    for mode in args.modes:
        for tiers in mixes:
            name = f"{mode.replace('+', '_')}-{''.join(map(str, tiers))}"
            row = run_config(tiers, mode, args.steps, (args.out / name).resolve(), args.val_every)
            print(json.dumps(row), flush=True)
            runs.append(row)
    results = {"steps": args.steps, "mixes": mixes, "modes": args.modes, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.out / "table.png")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
