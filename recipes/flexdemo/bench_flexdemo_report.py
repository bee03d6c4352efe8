"""Plots and the docs table of ``recipes/flexdemo/bench_flexdemo.py``, from its ``results.json`` alone.

- ``loss_vs_wallclock.png``: validation loss against measured step time x steps, one panel per bandwidth;
- ``bytes_per_step.png``: wire bytes per step and node of every variant;
- ``frontier.png``: wire bytes per step against the validation-loss gap to the baseline at the last step (one point
  per variant), and the speedup to the target loss against the bandwidth (default and best variants);
- :func:`markdown_table`: the table of docs/flexdemo.md, every number read from the analysis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flexdemo_variants import parse_variant

UNTHROTTLED = "unthrottled"


def step_cost(measured: dict[str, Any], variant: str) -> tuple[float, float]:
    """(seconds, busiest-direction wire bytes) per step: medians, or means over whole periods for DiLoCo."""
    if parse_variant(variant).periodic and measured.get("mean_step_s") is not None:
        wire = max(measured["wire_tx_bytes_per_step_mean"], measured["wire_rx_bytes_per_step_mean"])
        return measured["mean_step_s"], wire
    return measured["median_step_s"], max(measured["wire_tx_bytes_per_step"], measured["wire_rx_bytes_per_step"])


def codec_cost(measured: dict[str, Any], variant: str) -> float | None:
    """Seconds of the replicator's own compute (encode + decode) per step, matching :func:`step_cost`; None when the
    run did not record it (baselines, runs made before the worker recorded it)."""
    key = "mean_codec_s" if parse_variant(variant).periodic else "median_codec_s"
    return measured.get(key)


def _bandwidth_order(results: dict[str, Any]) -> list[str]:
    config = results["config"]
    listed = [*config["bandwidths"], *config.get("extra_bandwidths", [])]
    return list(dict.fromkeys(listed))


def plot(results: dict[str, Any], directory: Path) -> None:
    """Write loss_vs_wallclock.png, bytes_per_step.png and frontier.png into ``directory``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = results["config"]["bandwidths"]
    figure, axes = plt.subplots(1, len(bandwidths), figsize=(5 * len(bandwidths), 4), sharey=True, squeeze=False)
    for axis, bandwidth in zip(axes[0], bandwidths, strict=True):
        for variant, run in results["quality"].items():
            measured = results["speed"].get(parse_variant(variant).speed_key, {}).get(bandwidth)
            if measured is None:
                continue
            step_s = step_cost(measured, variant)[0]
            steps, losses = zip(*run["val_losses"], strict=True)
            axis.plot([s * step_s for s in steps], losses, label=variant, linewidth=1)
        axis.set_xscale("log")
        axis.set_title(f"validation loss vs training time @ {bandwidth}")
        axis.set_xlabel("seconds (measured step time x steps)")
    axes[0][0].set_ylabel("validation loss")
    axes[0][0].legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(directory / "loss_vs_wallclock.png", dpi=120)
    plt.close(figure)

    analysis = results["analysis"]
    primary = analysis.get("best_at") or bandwidths[-1]
    figure, axis = plt.subplots(figsize=(9, 4))
    variants = list(analysis["variants"])
    values = [analysis["variants"][v].get(primary, {}).get("wire_bytes_per_step") or 0 for v in variants]
    axis.bar(range(len(variants)), values)
    axis.set_yscale("log")
    axis.set_xticks(range(len(variants)), variants, rotation=60, ha="right", fontsize=7)
    axis.set_ylabel(f"wire bytes per step per node @ {primary}")
    figure.tight_layout()
    figure.savefig(directory / "bytes_per_step.png", dpi=120)
    plt.close(figure)
    _plot_frontier(results, directory / "frontier.png", primary)


def _plot_frontier(results: dict[str, Any], path: Path, primary: str) -> None:
    import matplotlib.pyplot as plt

    analysis = results["analysis"]
    rows = analysis["variants"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, row in rows.items():
        wire = row.get(primary, {}).get("wire_bytes_per_step")
        if not wire:
            continue
        baseline = variant == analysis["baseline"]
        left.scatter(
            wire, 100 * row["loss_vs_baseline"], marker="s" if baseline else "o", color="k" if baseline else None
        )
        left.annotate(
            variant, (wire, 100 * row["loss_vs_baseline"]), fontsize=6, xytext=(3, 3), textcoords="offset points"
        )
    left.set_xscale("log")
    left.axhline(0, color="grey", linewidth=0.5)
    steps = results["config"]["steps"]
    left.set_xlabel(f"wire bytes per step per node @ {primary} (measured)")
    left.set_ylabel(f"val loss gap vs {analysis['baseline']} @ step {steps} (%)")
    left.set_title("bytes vs loss gap")
    order = sorted(_bandwidth_order(results), key=lambda bw: bw != UNTHROTTLED)  # unthrottled (veth) first
    for label, variant in (("default", analysis.get("default")), ("best", analysis.get("best"))):
        if not variant:
            continue
        points = [(bw, rows[variant].get(bw, {}).get("speedup_to_target")) for bw in order]
        points = [(bw, value) for bw, value in points if value]
        if points:
            right.plot([order.index(bw) for bw, _ in points], [v for _, v in points], "o-", label=f"{label}: {variant}")
    right.axhline(1, color="grey", linewidth=0.5)
    right.set_xticks(range(len(order)), order)
    right.set_xlabel("inter-node bandwidth")
    right.set_ylabel(f"speedup to target ({analysis['target_val_loss']}) vs {analysis['baseline']}")
    right.set_title("speedup to target vs bandwidth")
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown_table(results: dict[str, Any]) -> str:
    """The docs table: variant, val loss, gap, bytes/step, bytes ratio, step time and speedup per throttled link."""
    analysis = results["analysis"]
    throttled = [bw for bw in _bandwidth_order(results) if bw != UNTHROTTLED]
    steps = results["config"]["steps"]
    operating = analysis.get("operating_point", {})
    primary = analysis.get("best_at") or (throttled[0] if throttled else UNTHROTTLED)
    header = ["variant", f"val loss @{steps}", "gap vs baseline", f"wire bytes/step @{primary}", "bytes ratio"]
    for bw in throttled:
        r = operating.get(bw, {}).get("ratio")
        header += [f"s/step @{bw}", f"speedup to target @{bw}" + (f" (R = {r:.1f})" if r else "")]
    header.append(f"steps to {analysis['target_val_loss']}")
    header += [f"step / physical limit @{primary}", f"codec s/step @{primary}", "step / max(compute + codec, link)"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for variant, row in analysis["variants"].items():
        tags = [tag for tag in ("baseline", "default", "best") if analysis.get(tag) == variant]
        cells = [variant + (f" ({', '.join(tags)})" if tags else "")]
        cells += [f"{row['final_val_loss']:.4f}", f"{100 * row['loss_vs_baseline']:+.2f}%"]
        cell = row.get(primary, {})
        cells += [f"{cell['wire_bytes_per_step']:,.0f}" if cell else "-"]
        cells += [f"{cell['bytes_reduction_vs_baseline']}x" if cell.get("bytes_reduction_vs_baseline") else "-"]
        for bw in throttled:
            measured = row.get(bw)
            if not measured:
                cells += ["-", "-"]
                continue
            speedup = measured.get("speedup_to_target")
            cells += [f"{measured['step_s']:.2f}", f"{speedup:.2f}x" if speedup else "never"]
        cells.append(str(row["steps_to_target"]) if row["steps_to_target"] else "never")
        for key, form in (
            ("step_over_physical_limit", "{:.2f}"),
            ("codec_s", "{:.3f}"),
            ("step_over_compute_codec_or_link", "{:.2f}"),
        ):
            cells.append(form.format(cell[key]) if cell.get(key) is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
