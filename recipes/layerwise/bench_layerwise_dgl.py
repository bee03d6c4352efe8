"""DGL (strategy ``layerwise``) vs the plain and the subspace pipeline over a throttled link; DGL accuracy.

Three parts, written into ``docs/results/layerwise/results.json`` (top-level keys ``"pipeline"`` and ``"dgl"``;
the other keys of that file belong to ``recipes/layerwise/bench_layerwise.py`` and are kept):

- ``pipeline``: llama-tiny on Shakespeare, one stage per testbed node (``--stages``, default 2), the same steps,
  batches and tokens for every variant, through the bandwidth testbed (root needed):
  ``plain`` (GPipe/1F1B pipeline, fp32 activations forward and gradients back; :mod:`recipes.bench_subspace`'s
  worker), ``ssn16-fp32`` (the subspace pipeline, 16x fewer numbers per token), ``dgl`` / ``dgl-bf16`` (this
  strategy's runtime: local losses, activations forward only, no bubble). Reported: tokens/s, pipeline bytes per step
  (all stages), val loss after the run, and the operating point ``R`` = the plain pipeline's link time per step at
  the bandwidth (its bytes per boundary and direction per step / rate) over its compute time per step (its step time
  on unthrottled links, an upper bound, so ``R`` is a lower bound).
- ``dgl["matched"]``: DGL (2 stages, spawned gloo ranks) on exactly what ``recipes/layerwise/bench_layerwise.py``
  trains end to end and greedily: its CNN and ViT on MNIST-5k (test accuracy) and llama-tiny on Shakespeare (val loss),
  its data, seeded batches, AdamW + warmup-cosine schedule, learning rates, steps and evaluation; compare with its
  ``"end_to_end"`` and ``"greedy"`` rows in the same file.
- ``dgl["digits_cnn"]``: DGL accuracy on sklearn digits with the small CNN of
  :mod:`lowbit_experiments` (2 stages, spawned gloo ranks; test accuracy of the last stage's
  classifier and of stage 0's auxiliary head), next to the same CNN trained end to end in one process with the same
  optimizer and epochs.

    python recipes/layerwise/bench_layerwise_dgl.py                        # full (about an hour on 2 busy cores)
    python recipes/layerwise/bench_layerwise_dgl.py --skip digits matched  # only the testbed comparison
    python recipes/layerwise/bench_layerwise_dgl.py --quick                # smoke run (about 10 min), outputs/ only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# Siblings (bench_layerwise), the subspace pipeline recipe (its testbed runner) and the low-bit experiments (data, CNN).
sys.path[:0] = [str(REPO / "recipes" / name) for name in ("layerwise", "subspace_pipeline", "sparseflip")]
RESULTS = REPO / "docs" / "results" / "layerwise" / "results.json"
UNTHROTTLED = "unthrottled"
DGL_VARIANTS = {"dgl": "fp32", "dgl-bf16": "bf16", "dgl-int8": "int8"}


# ------------------------------------------------------------------------------------------------------ workers
def dgl_worker(args: argparse.Namespace) -> None:
    """One rank of a DGL run under the testbed: train ``--steps`` steps without per-step barriers; rank 0 writes."""
    import torch
    import torch.distributed as dist
    from bench_subspace import _take

    from lightning_hetero import comm
    from lightning_hetero.data import ShakespeareDataModule
    from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
    from lightning_hetero.layerwise.settings import LayerwiseSettings
    from lightning_hetero.models import CausalLMModule
    from lightning_hetero.pipeline.settings import PipelineSettings

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size, seed=0)
    data.prepare_data()
    data.setup("fit")
    module = CausalLMModule(preset=args.preset, config=data.hf_config_overrides(), learning_rate=args.learning_rate)
    module.configure_model()
    pipeline = PipelineSettings(num_stages=world, boundary_dtype=DGL_VARIANTS[args.variant])
    runtime = DecoupledRuntime(LayerwiseSettings(pipeline=pipeline, aux_head="linear"))
    runtime.setup(module, torch.device("cpu"), rank)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.learning_rate, weight_decay=0.1)
    torch.manual_seed(0)  # every stage must iterate the same batches in the same order
    batches = _take(data.train_dataloader(), args.steps)
    ledger = comm.get_ledger()
    stamps, losses = [], []
    dist.barrier()
    start = time.perf_counter()
    for step, batch in enumerate(batches):
        ledger.set_step(step)
        losses.append(float(runtime.train_step(batch)))
        optimizer.step()
        optimizer.zero_grad()
        stamps.append(time.perf_counter())
    runtime.flush()
    dist.barrier()
    total = time.perf_counter() - start
    gaps = [b - a for a, b in zip(stamps[args.warmup :], stamps[args.warmup + 1 :], strict=False)]
    period = torch.tensor([statistics.median(gaps) if gaps else total / len(batches)], dtype=torch.float64)
    comm.all_reduce(period, "max", label="metrics")  # the slowest stage sets the pace
    step_bytes = [ledger.step_totals(s).get(comm.PIPELINE, comm.LedgerTotals()).sent for s in range(len(batches))]
    sent = torch.tensor(step_bytes, dtype=torch.float64)
    comm.all_reduce(sent, "sum", label="metrics")
    torch.manual_seed(1)
    val_batches = _take(data.val_dataloader(), args.val_batches)
    val_loss = statistics.fmean(float(runtime.eval_step(batch)) for batch in val_batches)
    final = torch.tensor([statistics.fmean(losses[-max(1, len(losses) // 4) :])], dtype=torch.float64)
    stage_losses = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    comm.all_gather(stage_losses, final, label="metrics")
    if rank == 0:
        tokens_per_step = args.batch_size * args.seq_len
        summary = {
            "variant": args.variant,
            "stages": world,
            "median_step_s": float(period),
            "tokens_per_s": tokens_per_step / float(period),
            "tokens_per_s_incl_fill": tokens_per_step * len(batches) / total,
            "pipeline_bytes_per_step": float(statistics.median(sent.tolist()[args.warmup :])),
            "first_step_pipeline_bytes": float(sent[0]),
            "tokens": tokens_per_step * len(batches),
            "val_loss": val_loss,
            "final_train_loss_per_stage": [float(x) for x in stage_losses],
        }
        Path(args.out).write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()


def _run(command: list[str], tag: str, cwd: Path) -> None:
    completed = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{tag} failed (exit {completed.returncode}):\n{completed.stdout[-3000:]}{completed.stderr}")


def run_dgl_under_testbed(variant: str, bandwidth: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    tag = f"{variant}-{bandwidth}"
    out = out_dir / f"{tag}.json"
    command = [sys.executable, "-m", "lightning_hetero.testbed", "--nodes", str(args.stages), "--ranks-per-node", "1"]
    command += ["--report", str(out_dir / f"{tag}-testbed.json"), "--timeout", str(args.timeout)]
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
    for name in ("preset", "steps", "warmup", "batch_size", "seq_len", "val_batches", "learning_rate"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    start = time.perf_counter()
    _run(command, tag, out_dir)
    summary = json.loads(out.read_text())
    summary.update(bandwidth=bandwidth, wall_s=time.perf_counter() - start)
    return summary


def pipeline_part(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """DGL vs plain vs subspace pipeline on the testbed; R from the plain pipeline's unthrottled step time."""
    import bench_subspace

    # bench_subspace.run_under_testbed reads these; no validation curve here (val_every 0)
    sub_args = argparse.Namespace(**{**vars(args), "speed_steps": None, "headline": False, "val_every": 0})
    runs: list[dict[str, Any]] = []
    for bandwidth in [UNTHROTTLED, *args.bandwidths]:
        variants = ["plain"] if bandwidth == UNTHROTTLED else args.variants
        for variant in variants:
            if args.assemble:  # the per-run summaries the workers wrote in an earlier (interrupted) run
                written = out_dir / f"{variant}-{bandwidth}.json"
                if not written.is_file():
                    continue
                run = {**json.loads(written.read_text()), "bandwidth": bandwidth}
                run.pop("train_losses", None)
            elif variant in DGL_VARIANTS:
                run = run_dgl_under_testbed(variant, bandwidth, args, out_dir)
            else:
                run = bench_subspace.run_under_testbed(variant, bandwidth, sub_args, out_dir)
                run.pop("train_losses", None)
            runs.append(run)
            line = f"{variant:>10} @ {bandwidth:>11}: {run['tokens_per_s']:8.0f} tok/s, "
            line += f"{run['pipeline_bytes_per_step']:.0f} B/step, val loss {run['val_loss']:.4f}"
            print(line, file=sys.stderr)
    from lightning_hetero.comm import parse_bandwidth

    compute_s = next(r["median_step_s"] for r in runs if r["variant"] == "plain" and r["bandwidth"] == UNTHROTTLED)
    operating_points = {}
    for bandwidth in args.bandwidths:
        plain = next((r for r in runs if r["variant"] == "plain" and r["bandwidth"] == bandwidth), None)
        if plain is None:
            continue
        # per boundary and direction (links are full duplex): the plain pipeline sends forward and backward
        directions = 2 * max(1, args.stages - 1)
        link_s = 8 * plain["pipeline_bytes_per_step"] / directions / parse_bandwidth(bandwidth)  # bit/s
        operating_points[bandwidth] = {"link_s_per_step": link_s, "compute_s_per_step": compute_s,
                                       "R": link_s / compute_s}  # fmt: skip
        for run in runs:
            if run["bandwidth"] == bandwidth:
                run["speedup_vs_plain"] = run["tokens_per_s"] / plain["tokens_per_s"]
                run["bytes_vs_plain"] = run["pipeline_bytes_per_step"] / plain["pipeline_bytes_per_step"]
    return {"runs": runs, "operating_points": operating_points}


def accuracy_worker(rank: int, world_size: int, epochs: int, batch_size: int, train_limit: int) -> dict[str, Any]:
    """One rank of DGL on digits (CNN, 2 stages): train, then the test accuracy of its local head (stage 0) and of
    the whole model (last stage)."""
    import torch
    from lowbit_experiments import build_model, load_dataset
    from torch import nn

    from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
    from lightning_hetero.layerwise.settings import LayerwiseSettings
    from lightning_hetero.pipeline.settings import PipelineSettings

    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = load_dataset("digits")
    x_train, y_train = x_train[:train_limit], y_train[:train_limit]
    holder = nn.Module()
    holder.model = build_model("cnn", x_train.shape[-1])
    runtime = DecoupledRuntime(LayerwiseSettings(pipeline=PipelineSettings(num_stages=world_size), aux_head="mlp"))
    runtime.setup(holder, torch.device("cpu"), rank)
    optimizer = torch.optim.Adam(runtime.stage.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            index = order[start : start + batch_size]
            runtime.train_step({"pixel_values": x_train[index], "labels": y_train[index]})
            optimizer.step()
            optimizer.zero_grad()
    runtime.flush()
    test = {"pixel_values": x_test, "labels": y_test}
    logits = runtime.predict(test)
    result: dict[str, Any] = {"stage": runtime.stage_index}
    if logits is not None:
        result["test_accuracy"] = float((logits.argmax(-1) == y_test).float().mean())
    if runtime.stage_index == 0:  # its auxiliary head alone: what a 1-block model would score
        with torch.no_grad():
            hidden = runtime.stage.block(runtime.stage.stem(x_test), {})
            result["aux_test_accuracy"] = float((runtime.stage.head(hidden).argmax(-1) == y_test).float().mean())
    return result


def end_to_end_digits(epochs: int, batch_size: int, train_limit: int) -> float:
    """The same CNN, optimizer and epochs trained end to end in one process; test accuracy."""
    import torch
    from lowbit_experiments import build_model, load_dataset

    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = load_dataset("digits")
    x_train, y_train = x_train[:train_limit], y_train[:train_limit]
    model = build_model("cnn", x_train.shape[-1])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            index = order[start : start + batch_size]
            loss = torch.nn.functional.cross_entropy(model(x_train[index]), y_train[index])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        return float((model(x_test).argmax(-1) == y_test).float().mean())


def dgl_part(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_hetero.testing import run_distributed

    results = run_distributed(accuracy_worker, 2, args.epochs, 32, args.train_limit, timeout=args.timeout)
    last = next(r for r in results if "test_accuracy" in r)
    first = next(r for r in results if r["stage"] == 0)
    return {
        "digits_cnn": {
            "stages": 2,
            "epochs": args.epochs,
            "train_samples": args.train_limit,
            "dgl_test_accuracy": last["test_accuracy"],
            "dgl_stage0_aux_test_accuracy": first["aux_test_accuracy"],
            "end_to_end_test_accuracy": end_to_end_digits(args.epochs, 32, args.train_limit),
        }
    }


MATCHED_MODELS = ("cnn", "vit", "llama")
"""Models of ``recipes/layerwise/bench_layerwise.py`` run with DGL; its ``STEPS``, ``LRS`` and ``AUX`` are read from
it."""


def _bench_layerwise() -> Any:
    import bench_layerwise

    return bench_layerwise


def matched_worker(rank: int, world_size: int, name: str, steps: int, quick: bool) -> dict[str, Any]:
    """One rank of DGL on exactly what ``recipes/layerwise/bench_layerwise.py`` trains end to end and greedily (its
    model ``name``, data, seeded batch sequence, AdamW + warmup-cosine schedule, learning rate, aux head,
    evaluation)."""
    import torch
    from torch import nn

    from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
    from lightning_hetero.layerwise.settings import LayerwiseSettings
    from lightning_hetero.pipeline.settings import PipelineSettings

    l1 = _bench_layerwise()
    torch.set_num_threads(1)
    train, evaluation, vocab = l1.text_data(quick) if name == "llama" else l1.image_data(quick)
    lr, aux = l1.LRS[name], l1.AUX[name]
    holder = nn.Module()
    holder.model = l1.make_model(name, vocab)
    runtime = DecoupledRuntime(LayerwiseSettings(pipeline=PipelineSettings(num_stages=world_size), aux_head=aux))
    runtime.setup(holder, torch.device("cpu"), rank)
    optimizer = torch.optim.AdamW(runtime.stage.parameters(), lr=lr, weight_decay=0.0)
    draw = l1._sampler(train, 16 if name == "llama" else 64)
    start = time.perf_counter()
    for step in range(steps):
        l1._schedule(optimizer, lr, step, steps, warmup=min(50, steps // 10))
        optimizer.zero_grad(set_to_none=True)
        runtime.train_step(draw(step))
        optimizer.step()
    runtime.flush()
    seconds = time.perf_counter() - start
    runtime.stage.eval()
    outputs = [runtime.predict(batch) for batch in evaluation]
    if not runtime.is_last:
        return {"stage": runtime.stage_index}
    row: dict[str, Any] = {"model": name, "stages": world_size, "steps": steps, "lr": lr, "aux_head": aux}
    row["train_seconds"] = seconds
    if name == "llama":
        losses = [float(runtime.stack.loss(logits, batch)) for logits, batch in zip(outputs, evaluation, strict=True)]
        row["val_loss"] = sum(losses) / len(losses)
    else:
        correct = sum(int((o.argmax(-1) == b["labels"]).sum()) for o, b in zip(outputs, evaluation, strict=True))
        row["accuracy"] = correct / sum(len(b["labels"]) for b in evaluation)
    return row


def matched_part(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """One row per ``--matched`` model, as each finishes."""
    from lightning_hetero.testing import run_distributed

    for name in args.matched:
        steps = (_bench_layerwise().QUICK_STEPS if args.quick else _bench_layerwise().STEPS)[name]
        results = run_distributed(matched_worker, 2, name, steps, args.quick, timeout=args.timeout * 3)
        row = next(r for r in results if "model" in r)
        print(json.dumps(row), file=sys.stderr, flush=True)
        yield row


def _update_results(path: Path, entries: dict[str, Any]) -> dict[str, Any]:
    """Re-read ``path`` and replace only ``entries``' keys (other recipes write other keys of the same file)."""
    results = json.loads(path.read_text()) if path.is_file() else {}
    results.update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(results, indent=1))
    os.replace(temporary, path)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="dgl", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps, one epoch; writes under outputs/")
    parser.add_argument("--bandwidths", nargs="+", default=["80mbit"])
    parser.add_argument("--variants", nargs="+", default=["plain", "ssn16-fp32", "dgl", "dgl-bf16"])
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages = testbed nodes")
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4, help="of the plain/subspace pipelines")
    parser.add_argument("--schedule", default="1f1b", help="of the plain/subspace pipelines")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=15, help="digits CNN epochs")
    parser.add_argument("--train-limit", type=int, default=100_000, help="digits training samples used")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--matched", nargs="*", default=["cnn", "llama", "vit"], choices=MATCHED_MODELS,
                        help="DGL on recipes/layerwise/bench_layerwise.py's models, data and steps")  # fmt: skip
    parser.add_argument("--assemble", action="store_true",
                        help="no new runs: 'pipeline' from the per-run JSON files in --out-dir")  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=["pipeline", "digits", "matched"])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--results", type=Path, default=None, help=f"results JSON (default {RESULTS})")
    args = parser.parse_args()
    if args.worker:
        dgl_worker(args)
        return
    if args.quick:
        args.steps, args.warmup, args.val_batches, args.epochs, args.train_limit = 5, 1, 1, 1, 256
        args.variants, args.seq_len, args.matched = ["plain", "dgl"], 32, ["cnn"]
    default_dir = REPO / "outputs" / ("bench_layerwise_dgl_quick" if args.quick else "bench_layerwise_dgl")
    out_dir = (args.out_dir or default_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = args.results or (out_dir / "results.json" if args.quick else RESULTS)
    from lightning_hetero.data import ShakespeareDataModule

    ShakespeareDataModule(seq_len=args.seq_len, batch_size=args.batch_size).prepare_data()  # tokenize once
    revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    import torch

    meta = {"command": " ".join(["python", "recipes/layerwise/bench_layerwise_dgl.py", *sys.argv[1:]]),
            "git_revision": revision, "torch": torch.__version__,
            "config": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    if "pipeline" not in args.skip:
        results = _update_results(results_path, {"pipeline": {**meta, **pipeline_part(args, out_dir)}})
    if "digits" not in args.skip or "matched" not in args.skip:
        previous = json.loads(results_path.read_text()).get("dgl", {}) if results_path.is_file() else {}
        dgl = {**previous, **meta}
        if "digits" not in args.skip:
            dgl.update(dgl_part(args))
            _update_results(results_path, {"dgl": dgl})
        if "matched" not in args.skip:
            rows = {row["model"]: row for row in dgl.get("matched", [])}  # other models' rows stay
            for row in matched_part(args):
                rows[row["model"]] = {**row, "command": meta["command"], "git_revision": meta["git_revision"]}
                dgl["matched"] = list(rows.values())
                _update_results(results_path, {"dgl": dgl})  # after every model: a long run keeps what it did
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    print(json.dumps({key: results[key] for key in ("pipeline", "dgl") if key in results}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
