"""Plot of ``recipes/finetune/bench_finetune_smollm2.py``: validation loss before/after per strategy, loss vs
wall-clock."""

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
    shown = [best[name].get(key) for name in names for _, key in bars if best[name].get(key)]
    left.set_ylim(0.9 * min(shown), 1.03 * max(shown))  # the differences are a few %, not the whole bar
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


def markdown_table(results: dict[str, Any]) -> str:
    """The docs table (every strategy's best run), from ``results.json``: ``bench_finetune_smollm2.py --table``."""

    def number(value: Any, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| strategy | lr | val loss before | after conversion | after fine-tune | train wall-clock (s) "
        "| median step (s) | link bytes/step | vs baseline: val loss gap | train time speedup | fewer bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results["runs"].items():
        for run in sorted(runs, key=lambda r: r["learning_rate"]):
            best = results["best"][name]
            mark = " (best)" if len(runs) > 1 and run["learning_rate"] == best["learning_rate"] else ""
            versus = ["-", "-", "-"]
            if "baseline" in best and run["learning_rate"] == best["learning_rate"]:
                versus = [f"{best['val_loss_gap_pct']:+.2f}% vs {best['baseline']}",
                          f"{best['train_time_speedup']:.2f}x", f"{best['link_bytes_ratio']:.0f}x"]  # fmt: skip
            lines.append(
                f"| {name} | {run['learning_rate']:g}{mark} | {number(run['val_loss_before'])} "
                f"| {number(run.get('val_loss_after_conversion'))} | {number(run['val_loss_after'])} "
                f"| {run['train_s']:.0f} | {run['median_step_s']:.1f} | {run['link_bytes_per_step'] / 1e6:,.2f} MB "
                f"| {' | '.join(versus)} |"
            )
    return "\n".join(lines)
