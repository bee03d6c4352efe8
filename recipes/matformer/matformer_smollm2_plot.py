"""Plot of ``bench_matformer_smollm2.py``'s results: memory per tier, fine-tune losses/bytes, tier-mix table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20


def plot(results: dict[str, Any], folder: Path) -> None:
    """Write ``smollm2.png`` with one panel per section present in ``results``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = [name for name in ("memory", "finetune", "table") if name in results]
    if not sections:
        return
    figure, axes = plt.subplots(1, len(sections), figsize=(5.5 * len(sections), 4.2), squeeze=False)
    for axis, name in zip(axes[0], sections, strict=True):
        {"memory": _memory, "finetune": _finetune, "table": _table}[name](axis, results[name])
    figure.tight_layout()
    figure.savefig(folder / "smollm2.png", dpi=110)
    plt.close(figure)


def _memory(axis: Any, memory: dict[str, Any]) -> None:
    rows = memory["rows"]
    tiers = [row["tier"] for row in rows]
    axis.bar(
        [t - 0.2 for t in tiers], [row["rss_saving_bytes"] / MIB for row in rows], 0.4, label="measured (peak RSS)"
    )
    axis.bar([t + 0.2 for t in tiers], [row["analytic_saving_bytes"] / MIB for row in rows], 0.4, label="analytic FFN")
    for row in rows[1:]:
        axis.annotate(f"{row['rss_saving_of_analytic_pct']:.0f}%", (row["tier"], row["rss_saving_bytes"] / MIB),
                      ha="center", va="bottom", fontsize=8)  # fmt: skip
    axis.set_xticks(tiers)
    axis.set_xlabel("tier (FFN width 1536 >> tier)")
    axis.set_ylabel("memory saved vs tier 0 (MiB)")
    axis.set_title("SmolLM2-135M: peak memory saved per tier")
    axis.legend(fontsize=8)


def _finetune(axis: Any, finetune: dict[str, Any]) -> None:
    runs = finetune["testbed"]
    names = list(runs)
    before = [runs[n]["val_loss_before"]["tier0"] for n in names]
    after = [runs[n]["val_loss_after"]["tier0"] for n in names]
    xs = range(len(names))
    axis.bar([x - 0.2 for x in xs], before, 0.4, label="val loss before")
    axis.bar([x + 0.2 for x in xs], after, 0.4, label="val loss after (tier 0)")
    low, high = min(before + after), max(before + after)
    axis.set_ylim(low - 0.3, high + 0.3)  # the differences are tenths of a nat: do not start at 0
    for x, name in zip(xs, names, strict=True):
        mb = (runs[name]["per_rank"][0]["median_wire_tx_per_step"] or 0) / 1e6
        label = f"{runs[name]['wall_s']:.0f} s wall, {mb:.0f} MB/step"
        axis.annotate(label, (x, high + 0.15), ha="center", va="bottom", fontsize=8)
    axis.set_xticks(list(xs), names, fontsize=8)
    axis.set_ylabel("validation loss")
    axis.set_title(f"fine-tune over 2 testbed nodes at {finetune['bandwidth']}")
    axis.legend(fontsize=8, loc="lower left")


def _table(axis: Any, table: dict[str, Any]) -> None:
    labels = ["".join(map(str, row["tiers"])) for row in table["rows"]]
    for tier in (0, 1):
        axis.plot(labels, [row["val_loss_after"][f"tier{tier}"] for row in table["rows"]], "o-", label=f"tier {tier}")
    axis.set_xlabel("tiers of ranks 0..3 (mean)")
    axis.set_ylabel(f"validation loss after {table['steps']} steps")
    axis.set_title("tier-mix table, SmolLM2-135M")
    axis.legend(fontsize=8)
