"""Plot of ``recipes/bench_finetune_smollm2.py``: validation loss before/after per strategy, loss vs wall-clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(results: dict[str, Any], path: Path) -> None:
    """Left: each strategy's best run, val loss before (pretrained), after conversion (pipelines), after training.
    Right: training loss (rank 0) vs the training wall-clock, val loss before/after as markers at its ends."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = {name: min(runs, key=lambda r: r["val_loss_after"]) for name, runs in results["runs"].items()}
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    names = list(best)
    bars = [("before (pretrained)", "val_loss_before"), ("after conversion", "val_loss_after_conversion"),
            ("after fine-tune", "val_loss_after")]  # fmt: skip
    width = 0.8 / len(bars)
    for index, (label, key) in enumerate(bars):
        values = [best[name].get(key) or 0.0 for name in names]
        left.bar([i + index * width for i in range(len(names))], values, width, label=label)
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=20, ha="right")
    left.set_ylabel("validation loss (fixed held-out batches)")
    left.legend(fontsize=8)
    for name, run in best.items():
        clock = run["step_clock_s"]
        (line,) = right.plot(clock[1:], run["train_losses"], linewidth=1, label=f"{name} (lr {run['learning_rate']:g})")
        right.plot([0, clock[-1]], [run["val_loss_before"], run["val_loss_after"]], "o--", color=line.get_color(),
                   linewidth=0.6, markersize=4)  # fmt: skip
    right.set_xlabel(f"training wall-clock at {results['config']['bandwidth']} (s, sum of step times)")
    right.set_ylabel("training loss (lines), validation loss (markers)")
    right.legend(fontsize=8)
    config = results["config"]
    figure.suptitle(
        f"SmolLM2-135M on Shakespeare, 2 testbed nodes at {config['bandwidth']}, {config['steps']} steps, "
        f"R(DDP) = {results.get('R') or float('nan'):.1f}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
