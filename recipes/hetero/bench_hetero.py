"""Mixed-cluster benchmark: unequal nodes (kernel-enforced CPU quota and memory limit) against what a user does alone.

Every run is a Lightning Trainer (``recipes/hetero/hetero_worker.py``) on the bandwidth testbed, whose cgroups give each
node its own CPU quota and memory limit (``--node-cpu``/``--node-memory``, see docs/testbed.md): the slow node is
slow and the small node small because the kernel says so, never because the training code sleeps.

Scenarios (``--scenario``):

- ``memory``: node A (1 core, no limit) and node C (1 core, a memory limit between the full model's measured training
  peak and tier 1's, found by ``calibrate_memory``). Baselines: stock DDP on A + C (its failure is recorded) and A
  alone. Ours: MatFormer ``tiers: auto`` on A + C (mean, and the compressed ``demo`` exchange).
- ``speed``: node A (1 core) and node B (0.5 core). Baselines: stock DDP on A + B (waits for B) and A alone. Ours:
  MatFormer ``tiers: auto``, and the measured batch share (FlexDeMo and MatFormer).

Phases: tune (seed 0, every ``--lrs`` per side), seeds (each side's best rate at the other ``--seeds``), analysis.
The full model's validation loss (rank 0's model; tier 0 under MatFormer) is recorded against training wall-clock.
The target is the best baseline's final loss (mean over seeds) x (1 + ``--target-margin``); time to target is the
first evaluation at or under it. Each run is stored whole under ``--out-dir/runs``; ``--reuse`` skips finished ones.

    python recipes/hetero/bench_hetero.py --scenario speed --reuse --headline        # needs root (testbed cgroups)
    python recipes/hetero/bench_hetero.py --scenario memory --reuse --headline
    python recipes/hetero/bench_hetero.py --scenario speed --smoke                    # a few steps, one rate, one seed

Writes ``results.json`` and ``val_loss_vs_wallclock.png`` to ``--out-dir``; ``--headline`` writes
``hetero.<scenario>`` into docs/results/headline.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "recipes" / name) for name in ("hetero", "common")]  # siblings, shared helpers

from headline import HEADLINE, run_metadata, update_headline  # noqa: E402

WORKER = REPO / "recipes" / "hetero" / "hetero_worker.py"
MEMORY_MODEL = {"hidden_size": 384, "intermediate_size": 1024, "num_attention_heads": 6, "num_hidden_layers": 4}
"""llama-small's shape (FFN 2.67x hidden, as Llama) at 4 layers and the 2,048-token tokenizer: the FFN holds most of the
parameters and activations, as in real Llamas, so a tier's saving shows in the process peak."""


@dataclass(frozen=True)
class Side:
    """One way to train: the worker's arguments and how many of the scenario's nodes it uses."""

    name: str
    worker_args: tuple[str, ...]
    baseline: bool
    nodes: int = 2


SIDES = {
    "single": Side("single", ("--side", "single"), baseline=True, nodes=1),
    "ddp": Side("ddp", ("--side", "ddp"), baseline=True),
    "matformer-auto": Side("matformer-auto", ("--side", "matformer", "--tiers", "auto"), baseline=False),
    "matformer-auto-demo": Side(
        "matformer-auto-demo", ("--side", "matformer", "--tiers", "auto", "--mode", "demo"), baseline=False
    ),
    "matformer-auto-1.4": Side(
        "matformer-auto-1.4", ("--side", "matformer", "--tiers", "auto", "--max-slowdown", "1.4"), baseline=False
    ),
    "matformer-auto-demo-h0.2": Side(
        "matformer-auto-demo-h0.2",
        ("--side", "matformer", "--tiers", "auto", "--mode", "demo", "--memory-headroom", "0.2"),
        baseline=False,
    ),
    "matformer-share": Side(
        "matformer-share", ("--side", "matformer", "--tiers", "[0, 0]", "--batch-share", "auto"), baseline=False
    ),
    "flexdemo-share": Side("flexdemo-share", ("--side", "flexdemo", "--batch-share", "auto"), baseline=False),
    "flexdemo": Side("flexdemo", ("--side", "flexdemo"), baseline=False),
}
SCENARIOS: dict[str, dict[str, Any]] = {
    "memory": {
        "node_cpu": [1.0, 1.0],
        "sides": ["ddp", "single", "matformer-auto", "matformer-auto-demo"],
        "model_config": MEMORY_MODEL,
        "batch_size": 16,
    },
    "speed": {
        "node_cpu": [1.0, 0.5],
        "sides": [
            "ddp",
            "single",
            "matformer-auto",
            "matformer-auto-1.4",
            "flexdemo-share",
            "flexdemo",
            "matformer-share",
        ],
        "model_config": None,
        "batch_size": 8,
    },
}
NODE_NAMES = {"memory": ["A", "C"], "speed": ["A", "B"]}


# ---------------------------------------------------------------------------------------------------- runs
def run_tag(side: str, lr: float, seed: int, steps: int) -> str:
    """File-name tag of one run."""
    return f"{side}-lr{lr:g}-s{seed}-{steps}"


@dataclass(frozen=True)
class Plan:
    """How long one side trains: optimizer steps, warmup steps, evaluation interval."""

    steps: int
    lr_warmup: int
    val_every: int


def worker_argv(side: Side, lr: float, seed: int, plan: Plan, args: argparse.Namespace, out: Path) -> list[str]:
    """The worker command of one run."""
    scenario = SCENARIOS[args.scenario]
    argv = [sys.executable, str(WORKER), *side.worker_args, "--learning-rate", str(lr), "--seed", str(seed)]
    argv += ["--steps", str(plan.steps), "--lr-warmup", str(plan.lr_warmup), "--val-every", str(plan.val_every)]
    argv += ["--val-batches", str(args.val_batches), "--batch-size", str(args.batch_size or scenario["batch_size"])]
    argv += ["--seq-len", str(args.seq_len), "--out", str(out)]
    if scenario["model_config"]:
        argv += ["--model-config", json.dumps(scenario["model_config"])]
    return argv


def node_limits(args: argparse.Namespace, nodes: int) -> tuple[list[float], list[int | None]]:
    """CPU quota and memory limit of the first ``nodes`` nodes of the scenario."""
    cpu = list(SCENARIOS[args.scenario]["node_cpu"])[:nodes]
    memory: list[int | None] = [None, args.small_node_memory if args.scenario == "memory" else None][:nodes]
    return cpu, memory


def launch(side: Side, argv: list[str], args: argparse.Namespace) -> tuple[int, list[dict[str, Any]]]:
    """Run one worker command on the side's testbed nodes; its exit code and each node's report summary."""
    from lightning_hetero.testbed import Testbed

    cpu, memory = node_limits(args, side.nodes)
    with Testbed(nodes=side.nodes, ranks_per_node=1, bandwidth=args.bandwidth, node_cpu=cpu, node_memory=memory) as bed:
        result = bed.run(argv, timeout=args.run_timeout)
    return result.exit_code, [node_summary(node) for node in result.report.get("nodes", [])]


def side_plan(side_name: str, args: argparse.Namespace) -> Plan:
    """``--steps`` for every side, or, with ``--budget-seconds``, the steps that fill the budget at the side's own
    median step (measured by a short run of the side on its nodes, stored under ``--out-dir/budget``)."""
    if args.budget_seconds is None:
        return Plan(args.steps, args.lr_warmup, args.val_every)
    path = args.out_dir / "budget" / f"{side_name}.json"
    if args.stored_only and not path.is_file():
        return Plan(args.steps, args.lr_warmup, args.val_every)
    if not ((args.reuse or args.stored_only) and path.is_file()):
        out = path.with_suffix(".worker.json")
        side = SIDES[side_name]
        argv = worker_argv(side, args.grids[side_name][0], 0, Plan(args.budget_probe_steps, 0, 0), args, out)
        print(f"[bench_hetero] {args.scenario}: timing {side_name} for the budget", flush=True)
        exit_code, _ = launch(side, argv, args)
        median = json.loads(out.read_text())["median_step_s"] if exit_code == 0 and out.is_file() else None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"median_step_s": median, "exit_code": exit_code}))
    median = json.loads(path.read_text())["median_step_s"]
    steps = args.steps if median is None else max(20, round(args.budget_seconds / median))
    return Plan(steps, min(args.lr_warmup, steps // 10), max(1, steps // args.evaluations))


def run_once(side_name: str, lr: float, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train one run on the testbed (or reuse its stored record); returns the record, failures included.

    With ``--stored-only`` a run not stored yet is not trained: it is a failure with exit code None.
    """
    side, plan = SIDES[side_name], side_plan(side_name, args)
    tag = run_tag(side_name, lr, seed, plan.steps)
    record_path = args.out_dir / "runs" / f"{tag}.json"
    if (args.reuse or args.stored_only) and record_path.is_file():
        return json.loads(record_path.read_text())
    if args.stored_only:
        return {"side": side_name, "learning_rate": lr, "seed": seed, "ok": False, "exit_code": None, "nodes": []}
    out = args.out_dir / "runs" / f"{tag}.worker.json"
    out.unlink(missing_ok=True)
    started = time.perf_counter()
    print(f"[bench_hetero] {args.scenario}: {tag} on nodes {node_limits(args, side.nodes)}", flush=True)
    exit_code, nodes = launch(side, worker_argv(side, lr, seed, plan, args, out), args)
    record: dict[str, Any] = {
        "side": side_name,
        "learning_rate": lr,
        "seed": seed,
        "steps": plan.steps,
        "lr_warmup": plan.lr_warmup,
        "exit_code": exit_code,
        "wall_seconds": time.perf_counter() - started,
        "nodes": nodes,
        "ok": exit_code == 0 and out.is_file(),
    }
    if record["ok"]:
        record["worker"] = json.loads(out.read_text())
    record_path.parent.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=1))
    return record


def node_summary(node: dict[str, Any]) -> dict[str, Any]:
    """What the testbed report says of one node's limits, usage and wire bytes."""
    keep = ("node", "cpu_quota", "memory_limit_bytes", "cgroup", "wire")
    return {key: node[key] for key in keep if key in node}


def calibrate_memory(args: argparse.Namespace) -> dict[str, int]:
    """Measured training peaks of the memory model at full width and at tier 1, one process each on a testbed node.

    The peak is the node cgroup's own charge (what the kernel holds against a limit), not the process's resident
    set, which also counts shared-library pages charged elsewhere. The node gets a limit far above need, only so
    that the kernel accounts its memory.
    """
    from lightning_hetero.testbed import Testbed

    peaks = {}
    for name, width in (("full", MEMORY_MODEL["intermediate_size"]), ("tier1", MEMORY_MODEL["intermediate_size"] // 2)):
        out = args.out_dir / "calibration" / f"{name}.json"
        if not ((args.reuse or args.stored_only) and out.is_file()):
            config = {**MEMORY_MODEL, "intermediate_size": width}
            argv = [sys.executable, str(WORKER), "--side", "single", "--steps", "20", "--val-every", "20"]
            argv += ["--batch-size", str(SCENARIOS["memory"]["batch_size"]), "--seq-len", str(args.seq_len)]
            argv += ["--lr-warmup", "5", "--model-config", json.dumps(config), "--out", str(out.with_suffix(".w"))]
            with Testbed(nodes=1, node_cpu=[1.0], node_memory=[16 * 2**30]) as bed:
                result = bed.run(argv, timeout=args.run_timeout)
            if result.exit_code != 0:
                raise SystemExit(f"memory calibration of the {name} model failed (exit {result.exit_code})")
            peak = result.report["nodes"][0]["cgroup"]["memory_peak_bytes"]
            out.write_text(
                json.dumps({"cgroup_peak_bytes": peak, "worker": json.loads(out.with_suffix(".w").read_text())})
            )
        peaks[name] = json.loads(out.read_text())["cgroup_peak_bytes"]
    return peaks


# ---------------------------------------------------------------------------------------------------- analysis
def curve(record: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(step, training seconds, full-model validation loss) of a finished run."""
    return [tuple(point) for point in record["worker"]["val_losses"]] if record.get("ok") else []


def time_to(record: dict[str, Any], target: float) -> float | None:
    """Training seconds at the first evaluation at or under ``target`` (None: never)."""
    return next((seconds for _, seconds, loss in curve(record) if loss <= target), None)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def best_lr(runs: list[dict[str, Any]]) -> float | None:
    """The tuning run with the lowest final loss (None when every run failed)."""
    finished = [r for r in runs if r.get("ok")]
    return min(finished, key=lambda r: r["worker"]["final_val_loss"])["learning_rate"] if finished else None


def analyse(results: dict[str, Any], margin: float) -> dict[str, Any]:
    """Per side: final loss over seeds; the best baseline; the target; each side's time to it and speed-up."""
    summary: dict[str, Any] = {}
    for side, entry in results["sides"].items():
        finals = [r["worker"]["final_val_loss"] for r in entry["seeds"] if r.get("ok")]
        mean, std = mean_std(finals) if finals else (None, None)  # None, not NaN: results stay strict JSON
        failures = [{"seed": r["seed"], "exit_code": r["exit_code"], "nodes": r["nodes"]} for r in entry["seeds"]]
        entry["seeds"] = [r for r in entry["seeds"] if r.get("ok") or r["exit_code"] is not None]  # not run: left out
        summary[side] = {
            "best_lr": entry["best_lr"],
            "final_val_loss_mean": mean,
            "final_val_loss_std": std,
            "finished_seeds": len(finals),
            "failures": [f for f in failures if f["exit_code"] not in (0, None)],
            "tiers": next((r["worker"]["tiers"] for r in entry["seeds"] if r.get("ok")), None),
            "micro_batch_sizes": next((r["worker"]["micro_batch_sizes"] for r in entry["seeds"] if r.get("ok")), None),
            "median_step_s": next((r["worker"]["median_step_s"] for r in entry["seeds"] if r.get("ok")), None),
            "setup_seconds": next((r["worker"]["setup_seconds"] for r in entry["seeds"] if r.get("ok")), None),
        }
    baselines = [s for s in summary if SIDES[s].baseline and summary[s]["finished_seeds"]]
    if not baselines:
        return {"sides": summary, "best_baseline": None}
    best = min(baselines, key=lambda s: summary[s]["final_val_loss_mean"])
    target = summary[best]["final_val_loss_mean"] * (1 + margin)
    for side, entry in results["sides"].items():
        times = [time_to(r, target) for r in entry["seeds"] if r.get("ok")]
        reached = [t for t in times if t is not None]
        summary[side]["time_to_target_s"] = statistics.fmean(reached) if len(reached) == len(times) and times else None
        summary[side]["seeds_reaching_target"] = len(reached)
    base_time = summary[best]["time_to_target_s"]
    for side in summary:
        own = summary[side].get("time_to_target_s")
        summary[side]["speedup_time_to_target"] = base_time / own if own and base_time else None
        own_loss = summary[side]["final_val_loss_mean"]
        summary[side]["val_loss_gap_pct"] = (
            None if own_loss is None else 100 * (own_loss / summary[best]["final_val_loss_mean"] - 1)
        )
    return {"sides": summary, "best_baseline": best, "target": target}


def operating_point(results: dict[str, Any]) -> dict[str, Any] | None:
    """R = link time / compute time of stock DDP here: its measured wire bytes per step over the link rate, against
    node A's compute-only step (A alone). None without a finished DDP and single run."""
    from lightning_hetero.testbed.checks import parse_rate

    rate = parse_rate(results["bandwidth"])
    ddp = [r for r in results["sides"].get("ddp", {}).get("seeds", []) if r.get("ok")]
    single = [r for r in results["sides"].get("single", {}).get("seeds", []) if r.get("ok")]
    if not (rate and ddp and single and ddp[0]["nodes"]):
        return None
    sent = ddp[0]["nodes"][0]["wire"]["tx_bytes"] / max(ddp[0]["worker"]["steps"], 1)
    link_seconds = 8 * sent / rate
    compute_seconds = single[0]["worker"]["median_step_s"]
    return {
        "ddp_wire_bytes_per_step": sent,
        "link_seconds": link_seconds,
        "compute_seconds_node_a": compute_seconds,
        "R": link_seconds / compute_seconds,
    }


def plot(results: dict[str, Any], directory: Path) -> None:
    """Full-model validation loss against training wall-clock per side: mean over seeds, min-max shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for side, entry in results["sides"].items():
        curves = [curve(r) for r in entry["seeds"] if r.get("ok")]
        if not curves:
            continue
        length = min(len(c) for c in curves)
        seconds = [statistics.fmean(c[i][1] for c in curves) for i in range(length)]
        losses = [[c[i][2] for c in curves] for i in range(length)]
        (line,) = axis.plot(seconds, [statistics.fmean(v) for v in losses], label=f"{side} (lr {entry['best_lr']:g})")
        axis.fill_between(
            seconds, [min(v) for v in losses], [max(v) for v in losses], alpha=0.2, color=line.get_color()
        )
    target = results["analysis"].get("target")
    if target:
        axis.axhline(target, color="grey", linestyle=":", label="target (best baseline + margin)")
    axis.set_xlabel("training wall-clock (s)")
    axis.set_ylabel("full model validation loss")
    nodes = ", ".join(
        f"{name} {node['cpu']:g} core" + (f" {node['memory_bytes'] / 2**20:.0f} MiB" if node["memory_bytes"] else "")
        for name, node in results["nodes"].items()
    )
    budget = f"{results['budget_seconds']:g} s each" if results.get("budget_seconds") else f"{results['steps']} steps"
    axis.set_title(f"{results['scenario']}: {nodes}; link {results['bandwidth']}; {budget}", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / "val_loss_vs_wallclock.png", dpi=120)
    plt.close(figure)


def markdown_table(results: dict[str, Any]) -> str:
    """The docs table of a results.json: one row per side, the best baseline's time to target as the reference."""
    analysis = results["analysis"]
    lines = [
        "| side | lr | final val loss (mean +- std, seeds) | vs best baseline | median step (s) | set-up (s) "
        "| time to target (s) | speed-up | tiers / micro-batches |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side, entry in analysis["sides"].items():
        if not entry["finished_seeds"]:
            failure = entry["failures"][0] if entry["failures"] else {}
            lines.append(f"| {side} | - | failed (exit {failure.get('exit_code')}) | | | | | | |")
            continue
        layout = entry["tiers"] if entry["tiers"] is not None else entry["micro_batch_sizes"]
        target_time = entry.get("time_to_target_s")
        speedup = entry.get("speedup_time_to_target")
        lines.append(
            f"| {side} | {entry['best_lr']:g} | {entry['final_val_loss_mean']:.4f} +- {entry['final_val_loss_std']:.4f}"
            f" ({entry['finished_seeds']}) | {entry['val_loss_gap_pct']:+.2f}% | {entry['median_step_s']:.3f} "
            f"| {entry['setup_seconds']:.1f} | {'-' if target_time is None else f'{target_time:.0f}'} "
            f"| {'-' if speedup is None else f'{speedup:.2f}x'} | {layout if layout is not None else ''} |"
        )
    return "\n".join(lines)


def write_headline(results: dict[str, Any], path: Path = HEADLINE) -> None:
    """The ``hetero_<scenario>`` section of docs/results/headline.json: ours (best side) against the best baseline."""
    analysis = results["analysis"]
    best_baseline = analysis["best_baseline"]
    ours = [s for s in analysis["sides"] if not SIDES[s].baseline and analysis["sides"][s]["finished_seeds"]]
    if best_baseline is None or not ours:
        raise SystemExit("no finished baseline or no finished side of ours: nothing to write to the headline")
    best = min(ours, key=lambda s: analysis["sides"][s]["final_val_loss_mean"])
    entry = analysis["sides"][best]
    update_headline(
        f"hetero_{results['scenario']}",
        {
            "nodes": results["nodes"],
            "bandwidth": results["bandwidth"],
            "R": (results.get("operating_point") or {}).get("R"),
            "baseline": best_baseline,
            "ours": best,
            "baseline_final_val_loss_mean": analysis["sides"][best_baseline]["final_val_loss_mean"],
            "final_val_loss_mean": entry["final_val_loss_mean"],
            "val_loss_gap_pct": entry["val_loss_gap_pct"],
            "speedup_time_to_target": entry["speedup_time_to_target"],
            "seeds": results["seeds"],
            "steps": results["steps"],
            "budget_seconds": results.get("budget_seconds"),
            "learning_rates": results["lrs"],
            "finished_seeds": {s: analysis["sides"][s]["finished_seeds"] for s in analysis["sides"]},
            "sides": {s: analysis["sides"][s]["final_val_loss_mean"] for s in analysis["sides"]},
        },
        path=path,
        revision=results["metadata"]["git_revision"],
    )


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--sides", nargs="+", default=None, help="default: the scenario's sides")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 2e-3, 3e-3], help="tuned per side at seed 0")
    parser.add_argument(
        "--side-lrs",
        nargs="+",
        default=[],
        metavar="SIDE=LR[,LR...]",
        help="a side's own grid instead of --lrs (e.g. flexdemo-share=2e-3)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps of every side (without a budget)")
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=None,
        help="an equal training wall-clock budget instead: each side trains the steps that fill it at its own "
        "measured median step (a --budget-probe-steps run of the side first), cosine over those steps",
    )
    parser.add_argument("--budget-probe-steps", type=int, default=30)
    parser.add_argument("--evaluations", type=int, default=20, help="with --budget-seconds: evaluations per run")
    parser.add_argument("--lr-warmup", type=int, default=100)
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per rank (default: the scenario's)")
    parser.add_argument("--bandwidth", default="100mbit", help="every node link, per direction (tc syntax)")
    parser.add_argument(
        "--small-node-memory",
        type=int,
        default=None,
        help="memory: C's limit in bytes (default: midway between the measured full-model and tier-1 peaks)",
    )
    parser.add_argument("--target-margin", type=float, default=0.01)
    parser.add_argument("--run-timeout", type=float, default=7200)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true", help="keep finished runs under --out-dir/runs")
    parser.add_argument("--headline", action="store_true")
    parser.add_argument(
        "--stored-only", action="store_true", help="analyse the runs stored under --out-dir; train nothing new"
    )
    parser.add_argument("--smoke", action="store_true", help="8 steps, one rate, one seed (the CI check)")
    parser.add_argument("--markdown", action="store_true", help="print the docs table of --out-dir/results.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.lr_warmup, args.val_every, args.val_batches = 8, 2, 4, 2
        args.lrs, args.seeds = args.lrs[:1], args.seeds[:1]
    args.sides = args.sides or SCENARIOS[args.scenario]["sides"]
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown:
        parser.error(f"--sides {unknown}: unknown; choose from {sorted(SIDES)}")
    args.out_dir = args.out_dir or REPO / "docs" / "results" / f"hetero_{args.scenario}"
    args.grids = {side: list(args.lrs) for side in args.sides}
    for entry in args.side_lrs:
        side, _, rates = entry.partition("=")
        if side not in args.grids or not rates:
            parser.error(f"--side-lrs {entry!r}: write SIDE=LR[,LR...] with SIDE one of --sides {args.sides}")
        args.grids[side] = [float(rate) for rate in rates.split(",")]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.markdown:
        results = json.loads((args.out_dir / "results.json").read_text())
        print(markdown_table(results))
        return results
    args.out_dir.mkdir(parents=True, exist_ok=True)
    calibration = None
    if args.scenario == "memory" and args.small_node_memory is None:
        calibration = calibrate_memory(args)
        args.small_node_memory = (calibration["full"] + calibration["tier1"]) // 2
    cpu, memory = node_limits(args, 2)
    names = NODE_NAMES[args.scenario]
    results: dict[str, Any] = {
        "scenario": args.scenario,
        "nodes": {name: {"cpu": c, "memory_bytes": m} for name, c, m in zip(names, cpu, memory, strict=True)},
        "bandwidth": args.bandwidth,
        "steps": args.steps,
        "budget_seconds": args.budget_seconds,
        "batch_size_per_rank": args.batch_size or SCENARIOS[args.scenario]["batch_size"],
        "seeds": args.seeds,
        "lrs": args.grids,
        "memory_calibration": calibration,
        "metadata": run_metadata(),
        "sides": {},
    }
    for side in args.sides:
        tuning = [run_once(side, lr, args.seeds[0], args) for lr in args.grids[side]]
        lr = best_lr(tuning)
        seeds = [next(r for r in tuning if r["learning_rate"] == lr)] if lr is not None else tuning[:1]
        if lr is not None:
            seeds += [run_once(side, lr, seed, args) for seed in args.seeds[1:]]
        results["sides"][side] = {"tuning": tuning, "best_lr": lr, "seeds": seeds}
    results["analysis"] = analyse(results, args.target_margin)
    results["operating_point"] = operating_point(results)
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out_dir)
    print(json.dumps({"analysis": results["analysis"], "operating_point": results["operating_point"]}, indent=1))
    if args.headline:
        write_headline(results)
    return results


if __name__ == "__main__":
    main()
