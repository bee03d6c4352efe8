"""R against model size: measured compute per step here, all-reduce bytes per step, and a labelled projection.

R = (stock all-reduce baseline's link seconds per step) / (its compute seconds per step). For every model size that
runs on this machine the compute time is *measured*: one process, one thread (a testbed rank gets one of the 2
cores), forward + backward + AdamW step of a Llama at ``--micro-batch`` x ``--seq-len`` tokens, median of
``--steps`` steps after 2 warm-up steps. The link bytes per step are the fp32 gradient all-reduce over 2 nodes
(each node sends the gradient size once each way) times the wire overhead measured by
``recipes/flexdemo/bench_baselines.py`` (TCP/IP + gloo framing; 1.05 in docs/results/bench_baselines), so R at a
bandwidth follows exactly.

For 1B and 8B (Llama-3.2-1B, Llama-3.1-8B shapes) R is a **projection**: FLOPs per step / a throughput, either this
CPU core's measured FLOP rate (from the largest measured model) or an H100 at 40% MFU (bf16 dense), with the same
bytes formula. The projection is labelled as such in the JSON and the plot.

    python recipes/flexdemo/bench_operating_point.py            # ~3 min on 2 CPU cores
    python recipes/flexdemo/bench_operating_point.py --plot-only docs/results/operating_point/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "recipes" / name) for name in ("flexdemo", "common")]  # siblings, shared helpers

from headline import run_metadata  # noqa: E402

BASELINE_RESULTS = REPO / "docs" / "results" / "bench_baselines" / "results.json"
# SmolLM2-135M's published shape; step time does not depend on the weights' values, so a random init is timed.
SMOLLM2_135M = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
SHAKESPEARE_VOCAB = 2048  # the project's Shakespeare tokenizer; the presets' LM heads shrink to it in training


MEASURED_MODELS = ("llama-tiny", "llama-small", "llama-medium", "SmolLM2-135M")


def model_configs() -> dict[str, Any]:
    """The measured sizes: the llama presets at the Shakespeare vocabulary, and SmolLM2-135M's shape."""
    from transformers import LlamaConfig

    from lightning_hetero.models import build_config

    configs: dict[str, Any] = {
        name: build_config(name, {"vocab_size": SHAKESPEARE_VOCAB}) for name in MEASURED_MODELS[:3]
    }
    configs["SmolLM2-135M"] = LlamaConfig(**{k: v for k, v in SMOLLM2_135M.items() if k != "model_type"})
    return configs


def measure_compute(config: Any, micro_batch: int, seq_len: int, steps: int) -> dict[str, Any]:
    """Median seconds of forward + backward + AdamW step on one thread, with the FLOPs of that step."""
    import torch
    from operating_point import training_flops_per_step
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(3, config.vocab_size, (micro_batch, seq_len))
    seconds = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    matmul = params if tied else params - embedding
    flops = training_flops_per_step(
        matmul, config.num_hidden_layers, config.hidden_size, seq_len, micro_batch * seq_len
    )
    median = statistics.median(seconds[2:])
    return {"params": params, "compute_s": median, "flops_per_step": flops, "flops_per_s": flops / median}


def wire_overhead() -> float:
    """Measured wire bytes / fp32 gradient bytes of stock DDP (bench_baselines), or 1.0 without that file."""
    if not BASELINE_RESULTS.exists():
        return 1.0
    baseline = json.loads(BASELINE_RESULTS.read_text())
    runs = [run for run in baseline["runs"] if run["strategy"] == "ddp" and run.get("wire_tx_bytes_per_step")]
    if not runs:
        return 1.0
    # 2 nodes: each sends the gradient once (ring all-reduce); fp32 gradients are 4 bytes per parameter.
    return statistics.median(run["wire_tx_bytes_per_step"] / (4 * run["parameters"]) for run in runs)


def build_table(args: argparse.Namespace) -> dict[str, Any]:
    """Measured rows for the sizes that run here, projected rows for 1B and 8B, at every bandwidth."""
    from operating_point import (
        H100_BF16_FLOPS_AT_40_PCT_MFU,
        PROJECTION_MODELS,
        allreduce_link_bytes,
        operating_point,
        project_operating_point,
    )

    overhead = wire_overhead()
    measured: list[dict[str, Any]] = []
    for name, config in model_configs().items():
        if args.models and name not in args.models:
            continue
        compute = measure_compute(config, args.micro_batch, args.seq_len, args.steps)
        link_bytes = allreduce_link_bytes(compute["params"], 4.0, 2) * overhead
        row = {"model": name, "kind": "measured", **compute, "link_bytes_per_step": link_bytes}
        row["R"] = {bw: round(operating_point(link_bytes, bw, compute["compute_s"]).ratio, 2) for bw in args.bandwidths}
        measured.append(row)
        print(f"{name}: {compute['params']:,} params, {compute['compute_s']:.3f} s/step, R {row['R']}", file=sys.stderr)
    cpu_rate = measured[-1]["flops_per_s"]  # the largest model: the best sustained rate of one core here
    projected = []
    for shape in PROJECTION_MODELS:
        for device, rate, tokens in (
            ("this CPU core (measured rate)", cpu_rate, args.micro_batch * args.seq_len),
            ("H100 bf16 at 40% MFU (assumed)", H100_BF16_FLOPS_AT_40_PCT_MFU, args.gpu_tokens_per_step),
        ):
            row = {"model": shape.name, "kind": "projection", "device": device, "tokens_per_step": tokens, "R": {}}
            for bw in args.bandwidths:
                point = project_operating_point(
                    shape, tokens_per_step=tokens, seq_len=args.seq_len, bandwidth=bw, flops_per_second=rate,
                    wire_overhead=overhead,
                )  # fmt: skip
                row.update(params=point["params"], compute_s=point["compute_s"], flops_per_step=point["flops_per_step"])
                row["R"][bw] = round(float(point["ratio"]), 2)
            projected.append(row)
    return {
        "meta": run_metadata(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wire_overhead": overhead,
        "definition": "R = fp32 gradient all-reduce bytes per node per step x wire overhead / bandwidth, over the "
        "compute seconds of one step (one process, one thread, no communication)",
        "measured": measured,
        "projected": projected,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """R vs parameters at each bandwidth: solid measured, dashed projection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for bandwidth in results["config"]["bandwidths"]:
        xs = [row["params"] for row in results["measured"]]
        line = axis.plot(xs, [row["R"][bandwidth] for row in results["measured"]], "o-", label=f"{bandwidth} measured")
        for device, style in (("this CPU", "x--"), ("H100", "s:")):
            rows = [row for row in results["projected"] if row["device"].startswith(device)]
            axis.plot([r["params"] for r in rows], [r["R"][bandwidth] for r in rows], style, color=line[0].get_color(),
                      label=f"{bandwidth} projected ({device})")  # fmt: skip
    axis.axhline(10, color="grey", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("parameters")
    axis.set_ylabel("R = all-reduce link time / compute time per step")
    axis.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", nargs="+", default=["20mbit", "100mbit", "1gbit"])
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (measured sizes)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model (after 2 warm-up steps)")
    parser.add_argument("--gpu-tokens-per-step", type=int, default=16 * 2048, help="projection: tokens per GPU step")
    parser.add_argument("--out-dir", type=Path, default=REPO / "docs" / "results" / "operating_point")
    parser.add_argument("--plot-only", type=Path)
    parser.add_argument("--models", nargs="+", help=f"measure only these (default: all of {MEASURED_MODELS})")
    args = parser.parse_args()
    unknown = sorted(set(args.models or []) - set(MEASURED_MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {MEASURED_MODELS}.")
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_name("r_vs_size.png"))
        return
    from lightning_hetero.comm import parse_bandwidth

    for bandwidth in args.bandwidths:
        parse_bandwidth(bandwidth)
    results = build_table(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out_dir / "r_vs_size.png")
    print(json.dumps({"measured": results["measured"], "projected": results["projected"]}, indent=1))


if __name__ == "__main__":
    main()
