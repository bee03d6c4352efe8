"""FlexDeMo against a tuned stock baseline over a real horizon: lr sweeps, three seeds, time to target at R >= 10.

One command per table (``--topology 2x2``: FlexDeMo vs stock ``ModelParallelStrategy`` + FSDP2 HSDP + torch AdamW;
``--topology 2x1``: FlexDeMo vs stock DDP), each run whole, ``--reuse`` resumes a sweep:

    python recipes/flexdemo/bench_flexdemo_horizon.py --topology 2x2 --reuse --headline    # the HSDP table
    python recipes/flexdemo/bench_flexdemo_horizon.py --topology 2x1 --reuse --headline    # the DDP table

Phases (``recipes/flexdemo/bench_worker.py`` trains every run; variant names:
``recipes/flexdemo/flexdemo_variants.py``):

1. **Tune, seed 0.** The baseline at every ``--baseline-lrs`` and ``--flexdemo`` at every ``--flexdemo-lrs``; then
   each ``--knobs`` variant (kept_fraction, sign vs values, DeMo + DiLoCo) at FlexDeMo's best rate. Same token budget,
   same data order, same warmup + cosine schedule for every run.
2. **Seeds.** The best baseline and the best FlexDeMo setting (lowest final validation loss at seed 0) again at every
   other ``--seeds`` entry (the seed sets the model initialization; the data order is fixed).
3. **Speed** at ``--bandwidth`` on the testbed (root needed): a few steps of the two winners, median step time and wire
   bytes; and the compute-only step (one single-thread process per rank, all at once) for R.

Quality runs train on this host over loopback (``torchrun --nnodes N`` with one agent per node): a run's losses do not
depend on the link (runs are deterministic; the testbed gives the same losses to the last digit, 5x slower). Time to
target = (first validated step at or under the target) x (the run's median step time at ``--bandwidth``); the target
is the tuned baseline's final validation loss (mean over seeds) x ``(1 + --target-margin)``.

Writes ``results.json``, ``val_loss_vs_tokens.png``, ``val_loss_vs_wallclock.png`` and ``tuning.png`` to
``--out-dir``; ``--headline`` writes the ``flexdemo_horizon`` (2x2) or ``flexdemo_horizon_ddp`` (2x1) section of
docs/results/headline.json; ``--markdown`` prints the docs table of an existing results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "recipes" / name) for name in ("flexdemo", "common")]  # siblings, shared helpers

from bench_flexdemo_report import step_cost  # noqa: E402
from flexdemo_variants import parse_variant, validate_variant  # noqa: E402
from headline import run_metadata, update_headline  # noqa: E402
from operating_point import operating_point  # noqa: E402

WORKER = REPO / "recipes" / "flexdemo" / "bench_worker.py"
TOPOLOGIES = {"2x2": (2, 2), "2x1": (2, 1)}
BASELINE_OF = {"2x2": "hsdp", "2x1": "ddp"}


def variant_tag(variant: str, seed: int, steps: int) -> str:
    """File-name tag of one quality run."""
    return f"{variant.replace('/', '_')}-s{seed}-{steps}"


def free_port() -> int:
    """A free TCP port on the loopback interface for the rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker_command(variant: str, seed: int, steps: int, args: argparse.Namespace, batch_size: int) -> list[str]:
    """The worker's arguments (after the script path) for one run of ``variant``."""
    command = ["--learning-rate", "3e-3", *parse_variant(variant).worker_args()]
    command += ["--steps", str(steps), "--preset", args.preset, "--batch-size", str(batch_size)]
    command += ["--seq-len", str(args.seq_len), "--seed", str(seed), "--lr-warmup", str(args.lr_warmup)]
    return command


def per_rank_batch(args: argparse.Namespace) -> int:
    """Sequences per rank per step: the global batch is the same on every topology."""
    nodes, ranks_per_node = TOPOLOGIES[args.topology]
    world = nodes * ranks_per_node
    if args.global_batch % world:
        raise ValueError(f"--global-batch {args.global_batch} is not divisible by the {world} ranks of {args.topology}")
    return args.global_batch // world


def launch_on_loopback(worker: list[str], nodes: int, ranks_per_node: int, prefix: Path) -> list[subprocess.Popen]:
    """Start every rank of a ``nodes x ranks_per_node`` job on this host, torchrun-style (as the testbed does).

    Each rank gets the environment of :func:`lightning_hetero.testbed.launch.rank_environment` (so Lightning sees a
    torchelastic launch) with gloo on the loopback interface and one intra-op thread per rank.
    """
    from lightning_hetero.testbed.launch import rank_environment

    port = free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = []
    for node in range(nodes):
        for local in range(ranks_per_node):
            env = rank_environment(
                base,
                nodes=nodes,
                ranks_per_node=ranks_per_node,
                node_rank=node,
                local_rank=local,
                master_addr="127.0.0.1",
                master_port=port,
                ledger_dir=str(prefix.parent),
                run_id=prefix.name,
                cpu_count=os.cpu_count() or 1,
            )
            env["GLOO_SOCKET_IFNAME"] = "lo"
            rank = node * ranks_per_node + local
            with open(f"{prefix}-rank{rank}.log", "w") as log:
                command = [sys.executable, *worker]
                ranks.append(subprocess.Popen(command, env=env, cwd=prefix.parent, stdout=log, stderr=log))
    return ranks


def wait_for_ranks(ranks: list[subprocess.Popen], timeout: float) -> list[int | str]:
    """Exit codes of ``ranks`` (``"timeout"`` for one still running after ``timeout`` seconds, then killed)."""
    deadline = time.monotonic() + timeout
    codes: list[int | str] = []
    for process in ranks:
        try:
            codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append("timeout")
    for process in ranks:
        if process.poll() is None:
            process.kill()
            process.wait()
    return codes


def quality_run(variant: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One whole run of ``variant`` on loopback, validated every ``--val-every`` steps (``--reuse``: cached)."""
    tag = variant_tag(variant, seed, args.steps)
    out = args.out_dir / f"{tag}.json"
    if args.reuse and out.exists():
        summary = json.loads(out.read_text())
        if summary.get("variant") == variant and summary.get("seed") == seed and summary.get("complete"):
            return summary
    nodes, ranks_per_node = TOPOLOGIES[args.topology]
    worker = [str(WORKER), *worker_command(variant, seed, args.steps, args, per_rank_batch(args))]
    worker += ["--out", str(out), "--val-every", str(args.val_every), "--val-batches", str(args.val_batches)]
    out.unlink(missing_ok=True)
    started = time.perf_counter()
    ranks = launch_on_loopback(worker, nodes, ranks_per_node, args.out_dir / tag)
    codes = wait_for_ranks(ranks, args.timeout)
    # Rank 0 writes the summary after fit; a peer that aborts in gloo's teardown after that lost no training.
    if codes[0] != 0 or not out.exists():
        logs = (args.out_dir / f"{tag}-rank0.log").read_text()[-3000:]
        raise RuntimeError(f"{tag} failed, exit codes {codes}:\n{logs}")
    summary = json.loads(out.read_text())
    summary.pop("step_seconds", None)
    summary.update(variant=variant, seed=seed, wall_s=round(time.perf_counter() - started, 1), complete=True)
    summary["exit_codes"] = codes
    summary["train_tokens"] = summary["tokens_per_step"] * args.steps
    out.write_text(json.dumps(summary, indent=1))
    for rank in range(len(ranks)):
        (args.out_dir / f"{tag}-rank{rank}.log").unlink(missing_ok=True)
    print(f"{tag}: final val loss {summary['val_losses'][-1][1]:.4f} ({summary['wall_s']} s)", file=sys.stderr)
    return summary


def speed_run(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Step time and wire bytes of ``variant`` at ``--bandwidth`` on the testbed (``bench_flexdemo.run_variant``)."""
    from bench_flexdemo import run_variant, speed_steps

    nodes, ranks_per_node = TOPOLOGIES[args.topology]
    testbed = argparse.Namespace(
        learning_rate=3e-3,
        preset=args.preset,
        batch_size=per_rank_batch(args),
        seq_len=args.seq_len,
        val_batches=args.val_batches,
        ranks_per_node=ranks_per_node,
        out_dir=args.out_dir,
        timeout=args.timeout,
        reuse=args.reuse,
        speed_steps=args.speed_steps,
        slow_link_speed_steps=args.speed_steps,
    )
    return run_variant(variant, args.bandwidth, speed_steps(variant, args.bandwidth, testbed), 0, testbed)


def compute_only(args: argparse.Namespace) -> float:
    """Median compute seconds per step: one single-thread process per rank, all at once (``bench_flexdemo``)."""
    from bench_flexdemo import run_compute_only

    nodes, ranks_per_node = TOPOLOGIES[args.topology]
    namespace = argparse.Namespace(
        out_dir=args.out_dir,
        ranks_per_node=ranks_per_node,
        reuse=args.reuse,
        preset=args.preset,
        batch_size=per_rank_batch(args),
        seq_len=args.seq_len,
    )
    return run_compute_only(namespace)["median_step_s"]


def final_loss(run: dict[str, Any]) -> float:
    """The run's last validation loss."""
    return run["val_losses"][-1][1]


def steps_to(run: dict[str, Any], target: float) -> int | None:
    """The first validated step at or under ``target`` (None: never)."""
    return next((step for step, loss in run["val_losses"] if loss <= target), None)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def pick_best(runs: dict[str, dict[str, Any]], names: list[str]) -> str:
    """The name with the lowest final validation loss at seed 0."""
    return min(names, key=lambda name: final_loss(runs[name]))


def analyse(
    tuning: dict[str, dict[str, Any]],
    seeds: dict[str, list[dict[str, Any]]],
    baseline: str,
    flexdemo: str,
    speed: dict[str, dict[str, Any]],
    compute_s: float | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Tuning table, seed statistics, time to target and the operating point R of one topology."""
    target = None
    base_finals = [final_loss(run) for run in seeds[baseline]]
    base_mean, base_std = mean_std(base_finals)
    target = base_mean * (1 + args.target_margin)
    sides: dict[str, Any] = {}
    for side, name in (("baseline", baseline), ("flexdemo", flexdemo)):
        runs = seeds[name]
        finals = [final_loss(run) for run in runs]
        mean, std = mean_std(finals)
        step_s, wire = step_cost(speed[name], name) if name in speed else (None, None)
        reached = [steps_to(run, target) for run in runs]
        times = [step * step_s for step in reached if step is not None and step_s]
        sides[side] = {
            "variant": name,
            "seeds": [run["seed"] for run in runs],
            "final_val_loss": [round(value, 4) for value in finals],
            "final_val_loss_mean": round(mean, 4),
            "final_val_loss_std": round(std, 4),
            "steps_to_target": reached,
            "step_s_at_link": round(step_s, 4) if step_s else None,
            "wire_bytes_per_step": wire,
            "time_to_target_s_mean": round(statistics.fmean(times), 1) if len(times) == len(runs) else None,
            "time_to_target_s_std": round(mean_std(times)[1], 1) if len(times) == len(runs) else None,
        }
    gaps = [100 * (f / b - 1) for f, b in zip(sides["flexdemo"]["final_val_loss"], base_finals, strict=False)]
    gap_mean = 100 * (sides["flexdemo"]["final_val_loss_mean"] / base_mean - 1)
    base_time, flex_time = sides["baseline"]["time_to_target_s_mean"], sides["flexdemo"]["time_to_target_s_mean"]
    base_wire, flex_wire = sides["baseline"]["wire_bytes_per_step"], sides["flexdemo"]["wire_bytes_per_step"]
    point = operating_point(base_wire, args.bandwidth, compute_s).as_dict() if base_wire and compute_s else None
    return {
        "topology": args.topology,
        "bandwidth": args.bandwidth,
        "R": point["ratio"] if point else None,
        "operating_point": point,
        "compute_s": compute_s,
        "target_val_loss": round(target, 4),
        "target_margin": args.target_margin,
        "tuning": {name: round(final_loss(run), 4) for name, run in tuning.items()},
        **sides,
        "val_loss_gap_pct": round(gap_mean, 2),
        "val_loss_gap_pct_per_seed": [round(gap, 2) for gap in gaps],
        "val_loss_gap_pct_std": round(mean_std(gaps)[1], 2),
        "speedup_time_to_target": round(base_time / flex_time, 2) if base_time and flex_time else None,
        "bytes_ratio": round(base_wire / flex_wire, 1) if base_wire and flex_wire else None,
    }


def plot(results: dict[str, Any], directory: Path) -> None:
    """val_loss_vs_tokens.png, val_loss_vs_wallclock.png (seeds shaded) and tuning.png (every seed-0 run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    analysis, seeds, tuning = results["analysis"], results["seeds"], results["tuning"]
    for kind in ("tokens", "wallclock"):
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for side, color in (("baseline", "tab:blue"), ("flexdemo", "tab:orange")):
            name = analysis[side]["variant"]
            runs = seeds[name]
            steps = np.array([step for step, _ in runs[0]["val_losses"]], dtype=float)
            losses = np.array([[loss for _, loss in run["val_losses"]] for run in runs])
            if kind == "tokens":
                x = steps * runs[0]["tokens_per_step"]
            elif analysis[side]["step_s_at_link"]:
                x = steps * analysis[side]["step_s_at_link"]
            else:
                continue
            mean, low, high = losses.mean(0), losses.min(0), losses.max(0)
            axis.plot(x, mean, color=color, label=f"{name} (mean of {len(runs)} seeds)")
            axis.fill_between(x, low, high, color=color, alpha=0.25, linewidth=0)
        axis.axhline(analysis["target_val_loss"], color="grey", linestyle=":", label="target")
        if kind == "tokens":
            axis.set_xlabel("training tokens")
        else:
            axis.set_xscale("log")
            axis.set_xlabel(f"seconds at {analysis['bandwidth']} (measured step time x steps; R = {analysis['R']})")
        axis.set_ylabel("validation loss")
        axis.set_ylim(top=min(axis.get_ylim()[1], analysis["target_val_loss"] * 1.5))
        axis.set_title(
            f"{analysis['topology']}: {analysis['baseline']['variant']} vs {analysis['flexdemo']['variant']}"
        )
        axis.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(directory / f"val_loss_vs_{kind}.png", dpi=120)
        plt.close(figure)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, run in tuning.items():
        steps, losses = zip(*run["val_losses"], strict=True)
        axis.plot(steps, losses, label=name, linewidth=1, linestyle="--" if parse_variant(name).baseline else "-")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("validation loss")
    axis.set_ylim(top=min(axis.get_ylim()[1], analysis["target_val_loss"] * 1.5))
    axis.set_title(f"{analysis['topology']} tuning (seed 0)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(directory / "tuning.png", dpi=120)
    plt.close(figure)


def markdown_table(results: dict[str, Any]) -> str:
    """The docs table: the two tuned sides, mean +- std over seeds."""
    analysis = results["analysis"]
    lines = [
        f"| side | variant | final val loss (mean +- std, {len(analysis['baseline']['seeds'])} seeds) "
        f"| steps to target | s/step @{analysis['bandwidth']} | time to target (s) | wire bytes/step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for side in ("baseline", "flexdemo"):
        row = analysis[side]
        time_cell = (
            f"{row['time_to_target_s_mean']} +- {row['time_to_target_s_std']}"
            if row["time_to_target_s_mean"] is not None
            else "not every seed"
        )
        lines.append(
            f"| {side} | {row['variant']} | {row['final_val_loss_mean']} +- {row['final_val_loss_std']} | "
            f"{row['steps_to_target']} | {row['step_s_at_link']} | {time_cell} | {row['wire_bytes_per_step']} |"
        )
    lines.append("")
    lines.append(
        f"R = {analysis['R']}, gap {analysis['val_loss_gap_pct']}% +- {analysis['val_loss_gap_pct_std']} "
        f"(per seed {analysis['val_loss_gap_pct_per_seed']}), speedup to target {analysis['speedup_time_to_target']}x, "
        f"{analysis['bytes_ratio']}x fewer bytes; target {analysis['target_val_loss']}."
    )
    lines.append("")
    lines.append("| tuning run (seed 0) | final val loss |")
    lines.append("|---|---:|")
    lines += [f"| {name} | {loss} |" for name, loss in analysis["tuning"].items()]
    return "\n".join(lines)


def write_headline(results: dict[str, Any], results_path: Path) -> None:
    """The ``flexdemo_horizon`` (2x2) or ``flexdemo_horizon_ddp`` (2x1) section of docs/results/headline.json."""
    analysis, config = results["analysis"], results["config"]
    section = "flexdemo_horizon" if analysis["topology"] == "2x2" else "flexdemo_horizon_ddp"
    try:
        shown = str(results_path.resolve().relative_to(REPO))
    except ValueError:
        shown = str(results_path)
    first = next(iter(results["seeds"].values()))[0]
    update_headline(
        section,
        {
            "R": analysis["R"],
            "bandwidth": analysis["bandwidth"],
            "topology": analysis["topology"],
            "steps": config["steps"],
            "train_tokens": first["train_tokens"],
            "seeds": analysis["flexdemo"]["seeds"],
            "baseline": analysis["baseline"]["variant"],
            "variant": analysis["flexdemo"]["variant"],
            "baseline_final_val_loss_mean": analysis["baseline"]["final_val_loss_mean"],
            "final_val_loss_mean": analysis["flexdemo"]["final_val_loss_mean"],
            "val_loss_gap_pct": analysis["val_loss_gap_pct"],
            "val_loss_gap_pct_std": analysis["val_loss_gap_pct_std"],
            "speedup_time_to_target": analysis["speedup_time_to_target"],
            "bytes_ratio": analysis["bytes_ratio"],
            "results": shown,
        },
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="2x2", help="nodes x ranks per node")
    parser.add_argument("--baseline-lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--flexdemo", default="demo-1/32-sign", help="the FlexDeMo variant tuned over --flexdemo-lrs")
    parser.add_argument("--flexdemo-lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2])
    parser.add_argument(
        "--knobs",
        nargs="*",
        default=["demo-1/16-sign", "demo-1/32-bf16", "diloco-h4-olr1-om0-demo1/32-bf16"],
        help="more FlexDeMo variants, run at FlexDeMo's best learning rate",
    )
    parser.add_argument(
        "--also",
        nargs="*",
        default=[],
        help="more runs, each at its own @lr (e.g. another exchange's sweep, or the baseline at another AdamW beta2:"
        " ddp-b0.999@3e-3), ranked with the rest of their side",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="the first one is the tuning seed")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr-warmup", type=int, default=100, help="linear warmup steps, then cosine to 0.1 x lr")
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per optimizer step over all ranks")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--val-every", type=int, default=40, help="<= 2%% of --steps")
    parser.add_argument("--val-batches", type=int, default=16, help="validation batches per rank")
    parser.add_argument("--bandwidth", default="20mbit", help="the throttled link of the speed runs")
    parser.add_argument("--speed-steps", type=int, default=10)
    parser.add_argument("--no-speed", action="store_true", help="skip the testbed speed runs (no root)")
    parser.add_argument("--target-margin", type=float, default=0.01, help="target = baseline mean x (1 + margin)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: outputs/flexdemo_horizon_<topology>")
    parser.add_argument("--reuse", action="store_true", help="take whole runs whose JSON is already in --out-dir")
    parser.add_argument("--headline", action="store_true")
    parser.add_argument("--markdown", type=Path, help="print the table of an existing results.json and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        return args
    try:
        validate_variant(args.flexdemo)
        for knob in args.knobs:
            validate_variant(knob)
            if "@" in knob:
                raise ValueError(f"--knobs {knob!r}: knobs run at FlexDeMo's best rate; drop the @lr")
        for extra in args.also:
            variant = validate_variant(extra)
            if variant.learning_rate is None:
                raise ValueError(f"--also {extra!r}: give its learning rate, e.g. demo-1/32@1e-3 or ddp-b0.999@3e-3")
            if variant.baseline and variant.strategy != BASELINE_OF[args.topology]:
                raise ValueError(
                    f"--also {extra!r}: the {args.topology} baseline is {BASELINE_OF[args.topology]}, not "
                    f"{variant.strategy}"
                )
        per_rank_batch(args)
    except ValueError as error:
        parser.error(str(error))
    if parse_variant(args.flexdemo).baseline:
        parser.error(f"--flexdemo {args.flexdemo!r} is a stock baseline; name a FlexDeMo variant")
    if args.val_every > max(1, args.steps // 50):
        parser.error(f"--val-every {args.val_every} is more than 2% of --steps {args.steps}; validate more often")
    args.out_dir = (args.out_dir or Path(f"outputs/flexdemo_horizon_{args.topology}")).resolve()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(args.markdown.read_text())))
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    from lightning_hetero.data import ShakespeareDataModule

    ShakespeareDataModule(seq_len=args.seq_len, batch_size=per_rank_batch(args)).prepare_data()  # tokenize once
    base = BASELINE_OF[args.topology]
    tuning_seed = args.seeds[0]
    tuning: dict[str, dict[str, Any]] = {}
    baselines = [f"{base}@{lr:g}" for lr in args.baseline_lrs]
    sweeps = [f"{args.flexdemo}@{lr:g}" for lr in args.flexdemo_lrs]
    for name in [*baselines, *sweeps]:
        tuning[name] = quality_run(name, tuning_seed, args)
    best_lr = parse_variant(pick_best(tuning, sweeps)).learning_rate
    knobs = [f"{knob}@{best_lr:g}" for knob in args.knobs]
    for name in [*knobs, *args.also]:
        tuning[name] = quality_run(name, tuning_seed, args)
    also_baselines = [name for name in args.also if parse_variant(name).baseline]
    also_flexdemo = [name for name in args.also if name not in also_baselines]
    baseline = pick_best(tuning, [*baselines, *also_baselines])
    flexdemo = pick_best(tuning, [*sweeps, *knobs, *also_flexdemo])
    seeds = {
        name: [tuning[name]] + [quality_run(name, seed, args) for seed in args.seeds[1:]]
        for name in (baseline, flexdemo)
    }
    speed: dict[str, dict[str, Any]] = {}
    compute_s = None
    if not args.no_speed:
        compute_s = compute_only(args)
        for name in (baseline, flexdemo):
            speed[name] = speed_run(name, args)
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    results = {
        "meta": run_metadata(),
        "config": config,
        "tuning": tuning,
        "seeds": seeds,
        "speed": speed,
        "analysis": analyse(tuning, seeds, baseline, flexdemo, speed, compute_s, args),
    }
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out_dir)
    if args.headline:
        write_headline(results, args.out_dir / "results.json")
    print(json.dumps({key: value for key, value in results["analysis"].items() if key != "tuning"}, indent=1))
    print(markdown_table(results))


if __name__ == "__main__":
    main()
