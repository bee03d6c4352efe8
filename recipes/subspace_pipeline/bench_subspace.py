"""Subspace pipeline vs plain pipeline over throttled links: wire bytes/step, tokens/s, val loss at equal tokens.

Every run goes through the bandwidth testbed (``python -m lightning_hetero.testbed``, root needed): ``--stages``
"nodes" (network namespaces, default 4), one pipeline stage per node, joined by veth links shaped with tc at each
bandwidth. Each run trains the same model (``--preset``) on Shakespeare for the same number of steps and tokens with
:class:`~lightning_hetero.subspace_pipeline.runtime.SubspacePipelineRuntime` (the core of ``SubspacePipelineStrategy``):

- ``plain``: ``compress=False``, fp32 boundaries (d numbers per token);
- ``int8``: ``compress=False`` with int8 boundary activations and gradients (lossy baseline, ~d bytes per token);
- ``ssn<r>-<dtype>``: the subspace pipeline at ``d/k = r`` with fp32 or bf16 coordinates (exact reconstruction).

Prints one JSON document and writes ``results.json`` (and ``bytes_and_throughput.png`` with matplotlib).

    python recipes/subspace_pipeline/bench_subspace.py                                  # full matrix, long
    python recipes/subspace_pipeline/bench_subspace.py --bandwidths 80mbit --variants plain ssn16-fp32 --steps 10
    python recipes/subspace_pipeline/bench_subspace.py --worker ... (internal: one rank, started by the testbed)
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
sys.path[:0] = [str(REPO / "recipes" / name) for name in ("subspace_pipeline", "common")]  # siblings, shared helpers
UNTHROTTLED = "unthrottled"
VARIANTS = ["plain", "int8"] + [f"ssn{r}-{dtype}" for r in (16, 32, 64) for dtype in ("fp32", "bf16")]


def variant_options(variant: str) -> dict[str, Any]:
    """Settings of a variant name (``plain``, ``int8``, ``ssn<ratio>-<fp32|bf16>``): ``compress``, ``dim_ratio``
    (``d / k``) and ``boundary_dtype`` (of :class:`~lightning_hetero.pipeline.settings.PipelineSettings`)."""
    if variant == "plain":
        return {"compress": False, "boundary_dtype": "fp32"}
    if variant == "int8":
        return {"compress": False, "boundary_dtype": "int8"}
    if variant.startswith("ssn") and "-" in variant:
        ratio, dtype = variant[3:].split("-", 1)
        return {"compress": True, "dim_ratio": float(ratio), "boundary_dtype": dtype}
    raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")


# ------------------------------------------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> None:
    """One rank: train ``--steps`` steps through the pipeline, record step times and bytes; rank 0 writes JSON."""
    import torch
    import torch.distributed as dist

    from lightning_hetero import comm
    from lightning_hetero.data import ShakespeareDataModule
    from lightning_hetero.models import CausalLMModule
    from lightning_hetero.pipeline.settings import PipelineSettings
    from lightning_hetero.subspace_pipeline.runtime import SubspacePipelineRuntime
    from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size, seed=0)
    data.prepare_data()
    data.setup("fit")
    module = CausalLMModule(preset=args.preset, config=data.hf_config_overrides(), learning_rate=args.learning_rate)
    module.configure_model()
    options = variant_options(args.variant)
    pipeline = PipelineSettings(num_stages=world, boundary_dtype=options.pop("boundary_dtype"))
    settings = SubspacePipelineSettings(
        pipeline=pipeline, n_microbatches=args.microbatches, schedule=args.schedule, **options
    )
    runtime = SubspacePipelineRuntime(settings)
    runtime.setup(module, torch.device("cpu"), rank)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.learning_rate, weight_decay=0.1)
    torch.manual_seed(0)  # every stage must iterate the same batches in the same order
    batches = _take(data.train_dataloader(), args.steps)
    ledger = comm.get_ledger()
    torch.manual_seed(1)
    val_batches = _take(data.val_dataloader(), args.val_batches)
    step_seconds, step_bytes, losses, val_curve = [], [], [], []
    for step, batch in enumerate(batches):
        ledger.set_step(step)
        dist.barrier()
        start = time.perf_counter()
        loss = runtime.train_step(batch, module)
        runtime.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step_seconds.append(time.perf_counter() - start)
        step_bytes.append(ledger.step_totals(step).get(comm.PIPELINE, comm.LedgerTotals()).sent)
        losses.append(float(loss))
        if args.val_every and (step + 1) % args.val_every == 0 and step + 1 < len(batches):
            val_curve.append([step + 1, statistics.fmean(float(runtime.eval_step(b, module)) for b in val_batches)])
    val_loss = statistics.fmean(float(runtime.eval_step(batch, module)) for batch in val_batches)
    val_curve.append([len(batches), val_loss])
    sent = torch.tensor(step_bytes, dtype=torch.float64)
    comm.all_reduce(sent, "sum", label="metrics")  # every stage's pipeline bytes per step
    if rank != 0:
        dist.destroy_process_group()
        return
    measured = step_seconds[args.warmup :]
    median = statistics.median(measured)
    tokens_per_step = args.batch_size * args.seq_len
    summary = {
        "variant": args.variant,
        "stages": world,
        "median_step_s": median,
        "tokens_per_s": tokens_per_step / median,
        "pipeline_bytes_per_step": float(statistics.median(sent.tolist()[args.warmup :])),
        "train_losses": losses,
        "tokens": tokens_per_step * len(batches),
        "val_loss": val_loss,
        "val_losses": val_curve,
        "boundary_bytes_per_microbatch": runtime.stage.boundary_bytes(
            args.batch_size // args.microbatches, args.seq_len
        ),
    }
    Path(args.out).write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()


def _take(loader: Any, count: int) -> list[Any]:
    batches: list[Any] = []
    while len(batches) < count:
        for batch in loader:
            batches.append(batch)
            if len(batches) == count:
                break
    return batches


# ------------------------------------------------------------------------------------------------ orchestrator
def run_under_testbed(variant: str, bandwidth: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """One run through the testbed (one stage per node); the worker summary plus bandwidth and wall time."""
    tag = f"{variant}-{bandwidth}"
    out, report = out_dir / f"{tag}.json", out_dir / f"{tag}-testbed.json"
    command = [sys.executable, "-m", "lightning_hetero.testbed", "--nodes", str(args.stages), "--ranks-per-node", "1"]
    command += ["--report", str(report), "--timeout", str(args.timeout)]
    if bandwidth != UNTHROTTLED:
        command += ["--bandwidth", bandwidth]
    command += [
        "--",
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--variant",
        variant,
        "--out",
        str(out),
    ]
    for name in ("preset", "warmup", "batch_size", "seq_len", "microbatches", "schedule", "val_batches"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    # Loss does not depend on the link: throttled runs only need enough steps for a stable median step time.
    steps = args.steps if bandwidth == UNTHROTTLED or not args.speed_steps else args.speed_steps
    command += ["--steps", str(steps), "--val-every", str(args.val_every if steps == args.steps else 0)]
    command += ["--learning-rate", str(args.learning_rate)]
    start = time.perf_counter()
    completed = subprocess.run(command, cwd=out_dir, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{tag} failed (exit {completed.returncode}):\n{completed.stdout[-3000:]}{completed.stderr}")
    summary = json.loads(out.read_text())
    summary.update(bandwidth=bandwidth, wall_s=time.perf_counter() - start)
    return summary


def compare_with_plain(results: dict[str, Any], stages: int) -> None:
    """Ratios against the plain pipeline at the same bandwidth, and R of the plain pipeline per bandwidth.

    R = (plain's bytes per boundary and direction per step / bandwidth) / (plain's step time on unthrottled links),
    the latter an upper bound on its compute time (so R is a lower bound). Needs an unthrottled plain run.
    """
    from operating_point import operating_point, physical_limit_ratio

    plain = {run["bandwidth"]: run for run in results["runs"] if run["variant"] == "plain"}
    for run in results["runs"]:
        base = plain.get(run["bandwidth"])
        if base is not None:
            run["bytes_reduction_vs_plain"] = base["pipeline_bytes_per_step"] / run["pipeline_bytes_per_step"]
            run["speedup_vs_plain"] = run["tokens_per_s"] / base["tokens_per_s"]
            if run["tokens"] == base["tokens"]:
                run["val_loss_vs_plain"] = run["val_loss"] / base["val_loss"] - 1.0
    unthrottled = plain.get(UNTHROTTLED)
    if unthrottled is None:
        return
    compute = {run["variant"]: run["median_step_s"] for run in results["runs"] if run["bandwidth"] == UNTHROTTLED}
    for run in results["runs"]:
        if run["bandwidth"] != UNTHROTTLED and run["variant"] in compute:
            # step / max(compute, busiest link bytes / bandwidth); compute = its unthrottled step (an upper bound)
            per_link = run["pipeline_bytes_per_step"] / (2 * (stages - 1))
            ratio = physical_limit_ratio(run["median_step_s"], compute[run["variant"]], per_link, run["bandwidth"])
            run["step_over_physical_limit"] = round(ratio, 2)
    results["operating_point"] = {}
    for bandwidth, run in plain.items():
        if bandwidth != UNTHROTTLED:
            per_link = run["pipeline_bytes_per_step"] / (2 * (stages - 1))  # each boundary, each direction
            point = operating_point(per_link, bandwidth, unthrottled["median_step_s"])
            results["operating_point"][bandwidth] = point.as_dict()


def write_headline(results: dict[str, Any], loss_budget_pct: float = 3.0) -> None:
    """The ``subspace`` section of docs/results/headline.json.

    The variant reported is the fastest subspace variant whose val loss at equal tokens is within ``loss_budget_pct``
    of plain's (the quality goal; the fastest of all if none is): ``tok_s_ratio_80mbit`` with the R of that link, and
    the same at the slowest measured bandwidth with R >= 10 (if any). The fastest variant regardless of loss is
    stored next to it, so a faster but worse variant is never hidden or passed off as the headline.
    """
    from headline import update_headline

    points = results.get("operating_point", {})
    subspace = [run for run in results["runs"] if run["variant"].startswith("ssn")]
    quality = {
        run["variant"]: run for run in subspace if run["bandwidth"] == UNTHROTTLED and "val_loss_vs_plain" in run
    }
    within = {name for name, run in quality.items() if 100 * run["val_loss_vs_plain"] <= loss_budget_pct}
    values: dict[str, Any] = {
        "results": "docs/results/bench_subspace_linkbound/results.json",
        "loss_budget_pct": loss_budget_pct,
    }
    for label, bandwidth in (("80mbit", "80mbit"), ("R10", None)):
        if bandwidth is None:
            ok = [bw for bw, point in points.items() if point["ratio"] >= 10]
            if not ok:
                continue
            bandwidth = min(ok, key=lambda bw: points[bw]["ratio"])
        runs = [run for run in subspace if run["bandwidth"] == bandwidth and "speedup_vs_plain" in run]
        if not runs or bandwidth not in points:
            continue
        fastest = max(runs, key=lambda run: run["speedup_vs_plain"])
        best = max([run for run in runs if run["variant"] in within] or runs, key=lambda run: run["speedup_vs_plain"])
        if label == "80mbit":
            values.update(R=points[bandwidth]["ratio"], tok_s_ratio_80mbit=round(best["speedup_vs_plain"], 2))
            values["variant_80mbit"] = best["variant"]
        else:
            values.update(
                R_at_R10=points[bandwidth]["ratio"], bandwidth_at_R10=bandwidth, variant_at_R10=best["variant"]
            )
            values["tok_s_ratio_at_R10"] = round(best["speedup_vs_plain"], 2)
        values[f"fastest_any_loss_{label}"] = {
            "variant": fastest["variant"],
            "tok_s_ratio": round(fastest["speedup_vs_plain"], 2),
            "val_loss_gap_pct": round(100 * quality[fastest["variant"]]["val_loss_vs_plain"], 2)
            if fastest["variant"] in quality
            else None,
        }
        chosen = quality.get(best["variant"])
        if chosen is not None:
            values[f"val_loss_gap_pct_{label}"] = round(100 * chosen["val_loss_vs_plain"], 2)
            values["quality_tokens"] = chosen["tokens"]
    values["val_loss_gap_pct"] = values.get("val_loss_gap_pct_R10", values.get("val_loss_gap_pct_80mbit"))
    update_headline("subspace", values, revision=results.get("meta", {}).get("git_revision"))


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    bandwidths = list(dict.fromkeys(run["bandwidth"] for run in runs))
    variants = list(dict.fromkeys(run["variant"] for run in runs))
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / max(1, len(bandwidths))
    for index, bandwidth in enumerate(bandwidths):
        values = [next((r["tokens_per_s"] for r in runs if r["variant"] == v and r["bandwidth"] == bandwidth), 0)
                  for v in variants]  # fmt: skip
        left.bar([i + index * width for i in range(len(variants))], values, width, label=bandwidth)
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(variants))], variants, rotation=45, ha="right")
    left.set_ylabel("tokens/s")
    left.set_yscale("log")
    left.legend(fontsize=8)
    first = {v: next(r for r in runs if r["variant"] == v) for v in variants}
    right.bar(variants, [first[v]["pipeline_bytes_per_step"] for v in variants])
    right.set_yscale("log")
    right.set_ylabel("pipeline bytes per step (all stages)")
    right.tick_params(axis="x", rotation=45)
    figure.suptitle(f"{results['config']['preset']}, {results['config']['stages']} stages, one per node")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_loss_curves(results: dict[str, Any], path: Path) -> None:
    """Validation loss vs tokens (unthrottled runs) and vs wall-clock at the slowest bandwidth (its median step)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    quality = [run for run in runs if run["bandwidth"] == UNTHROTTLED and len(run.get("val_losses", [])) > 1]
    if not quality:
        return
    throttled = [run["bandwidth"] for run in runs if run["bandwidth"] != UNTHROTTLED]
    slowest = throttled[-1] if throttled else UNTHROTTLED
    speed = {run["variant"]: run["median_step_s"] for run in runs if run["bandwidth"] == slowest}
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    tokens_per_step = int(results["config"]["batch_size"]) * int(results["config"]["seq_len"])
    for run in quality:
        steps, losses = zip(*run["val_losses"], strict=True)
        left.plot([s * tokens_per_step for s in steps], losses, label=run["variant"], linewidth=1)
        if run["variant"] in speed:
            right.plot([s * speed[run["variant"]] for s in steps], losses, label=run["variant"], linewidth=1)
    left.set_xlabel("tokens")
    right.set_xlabel(f"wall-clock at {slowest} (s, median step x steps)")
    right.set_xscale("log")
    for axis in (left, right):
        axis.set_ylabel("validation loss")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--bandwidths", nargs="+", default=[UNTHROTTLED, "80mbit", "20mbit"])
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages = testbed nodes")
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (equal tokens for every variant)")
    parser.add_argument("--speed-steps", type=int, help="steps of the throttled runs (default: --steps)")
    parser.add_argument("--headline", action="store_true", help="write the subspace section of headline.json")
    parser.add_argument("--loss-budget-pct", type=float, default=3.0, help="headline: largest val-loss gap allowed")
    parser.add_argument(
        "--from-results", type=Path, help="recompute ratios, headline and plots from this results.json (no runs)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing statistics")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps of the quality runs (0: end)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per testbed run")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/bench_subspace"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.from_results is not None:
        finish(json.loads(args.from_results.read_text()), args, args.from_results.parent)
        return

    from lightning_hetero.comm import parse_bandwidth
    from lightning_hetero.data import ShakespeareDataModule

    for variant in args.variants:
        variant_options(variant)  # fail before any run on a bad name
    for bandwidth in args.bandwidths:
        if bandwidth != UNTHROTTLED:
            parse_bandwidth(bandwidth)
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size).prepare_data()  # tokenize once
    from headline import run_metadata

    results: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    results["meta"] = {**run_metadata(), "seeds": {"model_and_batches": 0, "validation_batches": 1}}
    for bandwidth in args.bandwidths:
        for variant in args.variants:
            run = run_under_testbed(variant, bandwidth, args, out_dir)
            results["runs"].append(run)
            print(
                f"{variant:>11} @ {bandwidth:>11}: {run['tokens_per_s']:8.0f} tok/s, "
                f"{run['pipeline_bytes_per_step']:.0f} B/step, val loss {run['val_loss']:.4f}",
                file=sys.stderr,
            )
    finish(results, args, out_dir)


def finish(results: dict[str, Any], args: argparse.Namespace, out_dir: Path) -> None:
    """Ratios against plain, the headline section (with ``--headline``), results.json, plots and the printed JSON."""
    compare_with_plain(results, int(results["config"]["stages"]))
    if args.headline:
        write_headline(results, args.loss_budget_pct)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out_dir / "bytes_and_throughput.png")
    plot_loss_curves(results, out_dir / "loss_curves.png")
    keys = ("variant", "bandwidth", "tokens_per_s", "pipeline_bytes_per_step", "val_loss", "bytes_reduction_vs_plain",
            "speedup_vs_plain", "val_loss_vs_plain")  # fmt: skip
    print(json.dumps({"config": results["config"], "runs": [{k: r.get(k) for k in keys} for r in results["runs"]]}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
