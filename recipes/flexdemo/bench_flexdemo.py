"""FlexDeMo vs stock HSDP + AdamW on the bandwidth testbed: inter-node bytes, step time, loss, time to a target loss.

Two nodes x two ranks (network namespaces joined by tc-shaped veth links; root needed), ``llama-tiny`` on
Shakespeare, every variant from the same seed and data (``recipes/flexdemo/bench_worker.py`` does the training):

- ``hsdp``: stock Lightning ``ModelParallelStrategy`` + FSDP2 HSDP + torch AdamW (the testbed baseline);
- ``demo`` and ``random`` replicators at kept_fraction 1/16, 1/32, 1/64 with bf16 and sign values (FlexDeMoStrategy;
  the module's AdamW becomes DecoupledAdamW with the same hyperparameters);
- ``diloco`` (H = 32 local steps between syncs).

Two phases, because the loss of a run does not depend on the link (runs are deterministic) but its speed does:

1. quality, unthrottled: ``--steps`` steps, validation every ``--val-every`` steps (rank 0's validation shard);
2. speed, at every throttled ``--bandwidths`` entry: ``--speed-steps`` steps, median step time and the node's wire
   bytes per step (eth0 counters: payload, TCP/IP headers and gloo framing); unthrottled, phase 1's own numbers.

``--extra-bandwidths`` are measured afterwards for three variants only: the baseline, the default
(``--default-variant``, else the first FlexDeMo variant) and the best (fastest to target at the first throttled
``--bandwidths`` entry).

Derived: the target loss is HSDP's final validation loss x ``(1 + --target-margin)``; a variant's time to target is
(first validated step at or under the target) x (its median step time at that bandwidth), validation excluded.
DiLoCo sends only every H steps, so its speed runs last 2 + H steps and its step time and bytes are the means over
them (one whole period).

Variant names (``--variants``) follow the grammar of ``recipes/flexdemo/flexdemo_variants.py``: ``ddp@3e-3``,
``demo-1/32-sign@1e-3``, ``demo-1/16-sign-c128``, ``topk-1/32-bf16-noef``, ``diloco-h16-olr0.7``, ...; a bad name
fails before any run. Every run's JSON is kept in ``--out-dir``; ``--reuse`` takes an existing one instead of running
it again (same tag: variant, bandwidth, steps), and ``results.json`` is rewritten after every variant.

    sudo python recipes/flexdemo/bench_flexdemo.py                 # all variants: ~1.5 hours on 2 CPU cores
    python recipes/flexdemo/bench_flexdemo.py --variants hsdp demo-1/32-bf16 demo-1/32-sign diloco --steps 150
    python recipes/flexdemo/bench_flexdemo.py --plot-only outputs/bench_flexdemo/results.json
    python recipes/flexdemo/bench_flexdemo.py --reanalyse outputs/bench_flexdemo/results.json --target-loss 5.4
    python recipes/flexdemo/bench_flexdemo.py --markdown outputs/bench_flexdemo/results.json    # the docs table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "recipes" / name) for name in ("flexdemo", "common")]  # siblings, shared helpers

from bench_flexdemo_report import codec_cost, markdown_table, plot, step_cost  # noqa: E402
from flexdemo_variants import parse_variant, validate_variant  # noqa: E402
from headline import run_metadata  # noqa: E402
from operating_point import operating_point, physical_limit_ratio  # noqa: E402

from lightning_hetero.comm import parse_bandwidth  # noqa: E402
from lightning_hetero.data import ShakespeareDataModule  # noqa: E402

WORKER = REPO / "recipes" / "flexdemo" / "bench_worker.py"
UNTHROTTLED = "unthrottled"
COMPRESSIONS = {"1/16": 1 / 16, "1/32": 1 / 32, "1/64": 1 / 64}


def all_variants() -> list[str]:
    """``hsdp``, ``{demo,random}-{1/16,1/32,1/64}-{bf16,sign}``, ``diloco``."""
    sparse = [f"{r}-{c}-{v}" for r in ("demo", "random") for c in COMPRESSIONS for v in ("bf16", "sign")]
    return ["hsdp", *sparse, "diloco"]


def split_learning_rate(variant: str) -> tuple[str, float | None]:
    """``"demo-1/32-bf16@1e-3"`` -> ``("demo-1/32-bf16", 0.001)``; no ``@``: the run's ``--learning-rate``."""
    parsed = parse_variant(variant)
    return parsed.speed_key, parsed.learning_rate


def baseline_of(variant: str) -> bool:
    """Whether a variant is a stock baseline (``hsdp`` or ``ddp``, with or without an ``@lr``)."""
    return parse_variant(variant).baseline


def worker_args(variant: str) -> list[str]:
    """The worker's strategy arguments for a variant name (grammar: ``recipes/flexdemo/flexdemo_variants.py``)."""
    return parse_variant(variant).worker_args()


def speed_steps(variant: str, bandwidth: str, args: argparse.Namespace) -> int:
    """Steps of a speed run: enough for one whole period of a periodic variant (2 warm-up steps + H)."""
    slow = parse_bandwidth(bandwidth) < 50e6  # few steps suffice when each takes tens of seconds
    steps = args.slow_link_speed_steps if slow else args.speed_steps
    return max(steps, parse_variant(variant).period + 2)


def run_variant(variant: str, bandwidth: str, steps: int, val_every: int, args: argparse.Namespace) -> dict[str, Any]:
    """One testbed run of ``variant``: the worker's JSON summary plus bandwidth and wall time."""
    tag = f"{variant.replace('/', '_')}-{bandwidth}-{steps}"
    out = args.out_dir / f"{tag}.json"
    if args.reuse and out.exists():
        summary = json.loads(out.read_text())
        if summary.get("variant") == variant and summary.get("bandwidth") == bandwidth:
            summary.pop("step_seconds", None)
            return summary
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
    out.write_text(json.dumps(summary, indent=1))  # tagged, so that --reuse can take it
    summary.pop("step_seconds", None)
    return summary


def run_compute_only(args: argparse.Namespace) -> dict[str, Any]:
    """The compute part of a step: one single-thread process per testbed rank, all at once, no communication.

    The testbed runs ``2 x ranks_per_node`` ranks on this machine's cores; timing one process alone would understate
    their compute when they outnumber the cores, and so overstate R. The figure is the median over the processes.
    """
    out = args.out_dir / "compute-only.json"
    processes = 2 * args.ranks_per_node
    if not (args.reuse and out.exists() and json.loads(out.read_text()).get("processes") == processes):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        parts = [args.out_dir / f"compute-only-{index}.json" for index in range(processes)]
        running = []
        for part in parts:
            command = [sys.executable, str(WORKER), "--strategy", "single", "--steps", "12", "--out", str(part)]
            command += ["--preset", args.preset, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
            with part.with_suffix(".log").open("w") as log:
                running.append(subprocess.Popen(command, env=env, cwd=args.out_dir, stdout=log, stderr=log))
        for part, exit_code in zip(parts, [process.wait() for process in running], strict=True):
            if exit_code != 0:
                log = part.with_suffix(".log").read_text()[-3000:]
                raise RuntimeError(f"compute-only process failed (exit {exit_code}):\n{log}")
        summaries = [json.loads(part.read_text()) for part in parts]
        for part in parts:
            part.unlink()
            part.with_suffix(".log").unlink()
        summary = {key: value for key, value in summaries[0].items() if key != "step_seconds"}
        per_process = [entry["median_step_s"] for entry in summaries]
        summary.update(processes=processes, median_step_s=statistics.median(per_process), per_process_s=per_process)
        out.write_text(json.dumps(summary, indent=1))
    summary = json.loads(out.read_text())
    summary.pop("step_seconds", None)
    return summary


def analyse(
    quality: dict[str, dict],
    speed: dict[str, dict[str, dict]],
    margin: float,
    target_loss: float | None = None,
    compute_s: float | None = None,
    default_variant: str | None = None,
) -> dict[str, Any]:
    """Bytes ratios, loss gaps, time to target, R and the physical-limit ratio, relative to the tuned baseline.

    The baseline is the stock variant (``hsdp``/``ddp``, any ``@lr``) with the lowest final validation loss: it gets
    its own learning-rate tuning. The target is ``target_loss`` when given, else the baseline's final validation loss
    x ``(1 + margin)``. ``speed`` is keyed by variant name without ``@lr`` (step time does not depend on the rate).
    ``compute_s`` (one process, no communication) gives R and step / max(compute, wire / bandwidth), and where the run
    recorded its codec time, step / max(compute + codec, wire / bandwidth) (1.0: the exchange is hidden). ``default`` is
    ``default_variant`` (else the first FlexDeMo variant), ``best`` the FlexDeMo variant fastest to target at the
    first throttled bandwidth measured for every variant (none: unthrottled; ties: the lower loss), ``best_loss`` the
    lowest final loss.
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
            if bandwidth not in base_speed:
                continue  # nothing to compare with
            step_s, wire = step_cost(measured, variant)
            _, base_wire = step_cost(base_speed[bandwidth], best)
            row[bandwidth] = {
                "median_step_s": round(measured["median_step_s"], 4),
                "step_s": round(step_s, 4),
                "wire_bytes_per_step": wire,
                "bytes_reduction_vs_baseline": round(base_wire / wire, 1) if wire else None,
                "time_to_target_s": round(reached * step_s, 1) if reached else None,
            }
            if compute_s and bandwidth != UNTHROTTLED:
                row[bandwidth]["step_over_physical_limit"] = round(
                    physical_limit_ratio(step_s, compute_s, wire, bandwidth), 2
                )
                codec_s = codec_cost(measured, variant)
                if codec_s is not None:  # how well the exchange hides once the codec counts as compute
                    row[bandwidth]["codec_s"] = round(codec_s, 4)
                    row[bandwidth]["step_over_compute_codec_or_link"] = round(
                        physical_limit_ratio(step_s, compute_s + codec_s, wire, bandwidth), 2
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
                wire = step_cost(measured, best)[1]
                operating[bandwidth] = operating_point(wire, bandwidth, compute_s).as_dict()
    flexdemo = [variant for variant in rows if not baseline_of(variant)]
    complete = [bw for bw in base_speed if all(bw in rows[v] for v in flexdemo)]  # measured for every variant
    primary = next((bw for bw in complete if bw != UNTHROTTLED), complete[0] if complete else None)
    summary: dict[str, Any] = {"default": default_variant or (flexdemo[0] if flexdemo else None)}
    if flexdemo:
        summary["best_loss"] = min(flexdemo, key=lambda v: rows[v]["final_val_loss"])
    if flexdemo and primary:
        summary["best"] = max(
            flexdemo, key=lambda v: (rows[v][primary]["speedup_to_target"] or 0, -rows[v]["final_val_loss"])
        )
        summary["best_at"] = primary
    return {
        "baseline": best,
        "target_val_loss": round(target, 4),
        "compute_s": compute_s,
        "operating_point": operating,
        **summary,
        "variants": rows,
    }


def measure_speed(
    variant: str, bandwidth: str, quality: dict[str, dict], speed: dict, args: argparse.Namespace
) -> None:
    """Step time and wire bytes of ``variant`` at ``bandwidth`` into ``speed`` (once per name without ``@lr``)."""
    name = split_learning_rate(variant)[0]
    if bandwidth in speed.get(name, {}):
        return
    # Unthrottled, the quality run's own step times and wire bytes are the measurement (validation excluded).
    if bandwidth == UNTHROTTLED:
        speed.setdefault(name, {})[bandwidth] = quality[variant]
    else:
        speed.setdefault(name, {})[bandwidth] = run_variant(
            variant, bandwidth, speed_steps(variant, bandwidth, args), 0, args
        )
    step_s, wire = step_cost(speed[name][bandwidth], variant)
    print(f"{variant} @ {bandwidth}: {step_s:.3f} s/step, wire {wire:.0f} B/step", file=sys.stderr, flush=True)


def write_results(args: argparse.Namespace, compute: dict, quality: dict, speed: dict) -> dict[str, Any]:
    """results.json with the analysis of what has been measured so far (rewritten after every variant)."""
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    results = {"meta": run_metadata(), "config": config, "compute_only": compute, "quality": quality, "speed": speed}
    results["analysis"] = analyse(
        quality, speed, args.target_margin, args.target_loss, compute["median_step_s"], args.default_variant
    )
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants", nargs="+", default=all_variants(), help="names: recipes/flexdemo/flexdemo_variants.py"
    )
    parser.add_argument("--bandwidths", nargs="+", default=[UNTHROTTLED, "100mbit", "20mbit"])
    parser.add_argument(
        "--extra-bandwidths", nargs="*", default=[], help="measured for the baseline, the default and the best only"
    )
    parser.add_argument("--default-variant", help="the untuned FlexDeMo variant (default: the first FlexDeMo one)")
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
    parser.add_argument("--reuse", action="store_true", help="take runs whose JSON is already in --out-dir")
    parser.add_argument("--target-loss", type=float, help="explicit target validation loss (overrides the margin)")
    parser.add_argument("--plot-only", type=Path, help="re-plot an existing results.json and exit")
    parser.add_argument("--reanalyse", type=Path, help="recompute the analysis of a results.json (new target) and exit")
    parser.add_argument("--markdown", type=Path, help="print the table of an existing results.json and exit")
    args = parser.parse_args()

    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.parent)
        return
    if args.markdown:
        print(markdown_table(json.loads(args.markdown.read_text())))
        return
    if args.reanalyse:
        results = json.loads(args.reanalyse.read_text())
        compute = results.get("compute_only", {}).get("median_step_s")
        default = results["config"].get("default_variant")
        results["analysis"] = analyse(
            results["quality"], results["speed"], args.target_margin, args.target_loss, compute, default
        )
        args.reanalyse.write_text(json.dumps(results, indent=1))
        print(json.dumps(results["analysis"], indent=1))
        return
    try:
        for variant in args.variants:
            validate_variant(variant)  # fail on a bad name before any run
        if args.default_variant and args.default_variant not in args.variants:
            raise ValueError(f"--default-variant {args.default_variant!r} is not one of --variants")
        if args.default_variant and baseline_of(args.default_variant):
            raise ValueError(f"--default-variant {args.default_variant!r} is a baseline; name a FlexDeMo variant")
        for bandwidth in [*args.bandwidths, *args.extra_bandwidths]:
            if bandwidth != UNTHROTTLED:
                parse_bandwidth(bandwidth)
    except ValueError as error:
        parser.error(str(error))
    if not any(baseline_of(variant) for variant in args.variants):
        parser.error("--variants must include a stock baseline, hsdp or ddp (optionally @lr, e.g. ddp@1e-3).")
    if args.ranks_per_node == 1 and any(split_learning_rate(v)[0] == "hsdp" for v in args.variants):
        parser.error("hsdp shards within a node: use --ranks-per-node 2 for it, or the ddp baseline.")
    args.out_dir = args.out_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size).prepare_data()  # tokenize once

    compute = run_compute_only(args)
    print(f"compute only: {compute['median_step_s']:.3f} s/step", file=sys.stderr, flush=True)
    quality: dict[str, dict] = {}
    speed: dict[str, dict[str, dict]] = {}
    for variant in args.variants:
        quality[variant] = run_variant(variant, UNTHROTTLED, args.steps, args.val_every, args)
        print(f"{variant}: val losses {quality[variant]['val_losses'][-3:]}", file=sys.stderr, flush=True)
        for bandwidth in args.bandwidths:
            measure_speed(variant, bandwidth, quality, speed, args)
        results = write_results(args, compute, quality, speed)
    analysis = results["analysis"]
    chosen = dict.fromkeys([analysis["baseline"], analysis["default"], analysis.get("best")])
    for bandwidth in args.extra_bandwidths:
        for variant in filter(None, chosen):
            measure_speed(variant, bandwidth, quality, speed, args)
    results = write_results(args, compute, quality, speed)
    plot(results, args.out_dir)
    if args.headline:
        write_headline(results["analysis"], args.out_dir / "results.json")
    print(json.dumps({key: value for key, value in results["analysis"].items() if key != "variants"}, indent=1))
    print(markdown_table(results))


def write_headline(analysis: dict[str, Any], results_path: Path, bandwidth: str = "100mbit") -> None:
    """The ``flexdemo`` section of docs/results/headline.json: the default (untuned) variant's figures at 100 Mbit, and
    next to them the variant fastest to target among those within 2% of the baseline's loss (``best``)."""
    from headline import update_headline

    def figures(name: str) -> dict[str, Any]:
        row = analysis["variants"][name]
        return {
            "variant": name,
            "speedup_time_to_target_100mbit": row[bandwidth]["speedup_to_target"],
            "val_loss_gap_pct": round(100 * row["loss_vs_baseline"], 2),
            "bytes_ratio": row[bandwidth]["bytes_reduction_vs_baseline"],
            "step_over_physical_limit_100mbit": row[bandwidth].get("step_over_physical_limit"),
            "codec_s_100mbit": row[bandwidth].get("codec_s"),
            "step_over_compute_codec_or_link_100mbit": row[bandwidth].get("step_over_compute_codec_or_link"),
        }

    reached = {
        name: row
        for name, row in analysis["variants"].items()
        if not baseline_of(name) and row.get(bandwidth, {}).get("speedup_to_target")
    }
    point = analysis["operating_point"].get(bandwidth, {}).get("ratio")
    default = analysis.get("default")
    if default not in reached:
        update_headline("flexdemo", {"R": point, "variant": default, "reached": False})
        return
    within = [name for name, row in reached.items() if row["loss_vs_baseline"] <= 0.02]
    best = max(within or [default], key=lambda name: reached[name][bandwidth]["speedup_to_target"])
    try:
        shown = str(results_path.resolve().relative_to(REPO))
    except ValueError:
        shown = str(results_path)
    update_headline(
        "flexdemo",
        {
            "R": point,
            "baseline": analysis["baseline"],
            **figures(default),
            "best": figures(best),
            "baseline_final_val_loss": analysis["variants"][analysis["baseline"]]["final_val_loss"],
            "results": shown,
        },
    )


if __name__ == "__main__":
    main()
