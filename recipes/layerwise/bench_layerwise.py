"""Greedy layerwise training (seed 003, Belilovsky et al. 2018) against end-to-end training, measured.

Writes ``docs/results/layerwise/results.json`` (and ``results.png``): a dict with one key per experiment, so other
recipes can add theirs (``"dgl"``, ``"pipeline"``) next to them:

- ``end_to_end`` / ``greedy``: MNIST-5k test accuracy of a small CNN (3 conv stages) and the project's ViT-tiny
  (4 layers, 7x7 patches), and the tiny Llama's Shakespeare validation loss; greedy trains each block for as many
  steps as the end-to-end run takes in all, through a linear (CNN: pool + linear; Llama: norm + tied LM head)
  auxiliary head, with the frozen prefix served from the activation cache; the last block trains through the model's
  own head.
- ``retrain_last_block``: after greedy training, re-initialise the last block and its head and retrain only them on
  the cached base, with and without the cache, against the end-to-end run's time.
- ``lowbit``: ternary-weight (STE), binary-activation (sign, hardtanh STE) CNN blocks on MNIST-5k, end-to-end and
  greedy; the end-to-end low-bit figures of ``docs/results/lowbit/results.json`` are copied next to them.

Every run uses one CPU thread (timings on a shared machine are upper bounds).

    python recipes/layerwise/bench_layerwise.py  # the full run: 4 processes, 43 minutes on 2 overloaded CPU cores
    python recipes/layerwise/bench_layerwise.py --quick    # smoke run (a few steps; figures not meaningful)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "recipes" / "sparseflip"))  # lowbit_experiments: MNIST-5k, the low-bit CNN

from lightning_hetero.layerwise import ActivationCache, GreedyStages, split_into_blocks  # noqa: E402

OUT = REPO / "docs" / "results" / "layerwise"
SEED = 0
Batches = Callable[[int], dict[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------------- data
Split = tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], int]


def image_data(quick: bool) -> Split:
    """MNIST-5k: (training tensors, test batches, classes)."""
    from lowbit_experiments import load_dataset

    x_train, y_train, x_test, y_test = load_dataset("mnist", seed=0)
    if quick:
        x_train, y_train, x_test, y_test = x_train[:256], y_train[:256], x_test[:128], y_test[:128]
    return {"pixel_values": x_train, "labels": y_train}, _chunks({"pixel_values": x_test, "labels": y_test}), 10


def text_data(quick: bool) -> Split:
    """Shakespeare, 128-token blocks: (training tensors, validation batches, vocabulary size)."""
    from lightning_hetero.data import ShakespeareDataModule

    data = ShakespeareDataModule(seq_len=128, batch_size=16, vocab_size=2048, val_fraction=0.05)
    data.prepare_data()
    data.setup("fit")
    train = torch.cat([batch["input_ids"] for batch in data.train_dataloader()])
    val = [batch for _, batch in zip(range(2 if quick else 20), data.val_dataloader(), strict=False)]
    if quick:
        train = train[:64]
    return {"input_ids": train, "labels": train}, val, data.vocab_size


def _sampler(tensors: Mapping[str, torch.Tensor], batch_size: int = 64) -> Batches:
    """Seeded epoch permutations; every batch carries the sample indices (the activation cache's keys)."""
    rows = len(next(iter(tensors.values())))
    state = {"order": torch.Generator().manual_seed(SEED), "perm": torch.empty(0, dtype=torch.long), "at": 0}

    def draw(_: int) -> dict[str, torch.Tensor]:
        if state["at"] + batch_size > len(state["perm"]):
            state["perm"], state["at"] = torch.randperm(rows, generator=state["order"]), 0
        index = state["perm"][state["at"] : state["at"] + batch_size]
        state["at"] += batch_size
        return {**{k: v[index] for k, v in tensors.items()}, "index": index}

    return draw


def _chunks(tensors: Mapping[str, torch.Tensor], size: int = 500) -> list[dict[str, torch.Tensor]]:
    rows = len(next(iter(tensors.values())))
    return [{k: v[i : i + size] for k, v in tensors.items()} for i in range(0, rows, size)]


# ---------------------------------------------------------------------------------------------------- models
def make_model(name: str, vocab: int = 2048) -> nn.Module:
    torch.manual_seed(SEED)
    if name == "cnn":
        return cnn(binary=False)
    if name == "lowbit_cnn":
        return cnn(binary=True)
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification

    from lightning_hetero.models.presets import build_config

    if name == "vit":
        return AutoModelForImageClassification.from_config(build_config("vit-tiny", {"patch_size": 7}))
    return AutoModelForCausalLM.from_config(build_config("llama-tiny", {"vocab_size": vocab}))


class SignActivation(nn.Module):
    """Binary activation ``sign(x)`` with the hardtanh straight-through gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lightning_hetero.sparseflip import sign_ste

        return sign_ste(x)


def cnn(binary: bool) -> nn.Sequential:
    """3 conv stages (16, 32, 32 channels) + linear; ``binary``: ternary STE weights, BatchNorm + sign activations."""

    def act(channels: int) -> list[nn.Module]:
        return [nn.BatchNorm2d(channels), SignActivation()] if binary else [nn.ReLU()]

    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), *act(16), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), *act(32), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), *act(32),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )  # fmt: skip
    if binary:
        from lightning_hetero.sparseflip import convert_model

        convert_model(model, "ternary", "ste", "row", skip=())
    return model


# ---------------------------------------------------------------------------------------------------- training
def _schedule(optimizer: torch.optim.Optimizer, lr: float, step: int, steps: int, warmup: int) -> None:
    factor = (step + 1) / (warmup + 1) if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / steps))
    for group in optimizer.param_groups:
        group["lr"] = lr * factor


def _fit(params: list[nn.Parameter], loss_of: Callable[[dict], torch.Tensor], draw: Batches, steps: int, lr: float):
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for step in range(steps):
        _schedule(optimizer, lr, step, steps, warmup=min(50, steps // 10))
        optimizer.zero_grad(set_to_none=True)
        loss_of(draw(step)).backward()
        optimizer.step()


@torch.no_grad()
def evaluate(model: nn.Module, evaluation: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    stack = split_into_blocks(model)
    model.eval()
    if stack.task == "classification":
        correct = sum(int((stack(b).argmax(-1) == b["labels"]).sum()) for b in evaluation)
        result = {"accuracy": correct / sum(len(b["labels"]) for b in evaluation)}
    else:
        result = {"val_loss": sum(float(stack.loss(stack(b), b)) for b in evaluation) / len(evaluation)}
    model.train()
    return result


def end_to_end(name: str, model: nn.Module, draw: Batches, evaluation: list, steps: int, lr: float) -> dict[str, Any]:
    stack = split_into_blocks(model)
    start = time.perf_counter()
    _fit(list(model.parameters()), lambda batch: stack.loss(stack(batch), batch), draw, steps, lr)
    seconds = time.perf_counter() - start
    return {"model": name, "steps": steps, "lr": lr, "train_seconds": seconds, **evaluate(model, evaluation)}


def greedy(
    name: str, model: nn.Module, draw: Batches, evaluation: list, stage_steps: int, lr: float, aux: str
) -> tuple[dict[str, Any], GreedyStages]:
    torch.manual_seed(SEED)
    stages = GreedyStages(split_into_blocks(model), aux_head=aux, cache=ActivationCache("memory"))
    seconds, per_stage = [], []
    for stage in range(stages.num_stages):
        start = time.perf_counter()
        stages.enter_stage(stage)
        _fit(stages.active_parameters(), stages.stage_loss, draw, stage_steps, lr)
        seconds.append(time.perf_counter() - start)
        per_stage.append(evaluate_stage(stages, evaluation))
    stages.export_()
    row = {"model": name, "blocks": stages.num_stages, "aux_head": aux, "steps_per_stage": stage_steps, "lr": lr}
    row |= {"stage_seconds": seconds, "train_seconds": sum(seconds), "per_stage_head": per_stage}
    row |= {"cache": stages.cache.stats(), **evaluate(model, evaluation)}
    return row, stages


@torch.no_grad()
def evaluate_stage(stages: GreedyStages, evaluation: list) -> float:
    """The current stage's head on its block's output: accuracy (classifiers) or loss (LMs)."""
    stack = stages.stack
    modules = [stack.stem, *stack.blocks, stack.final_head, *stages.aux_heads]
    for module in modules:
        module.eval()
    saved, stages.cache = stages.cache, None  # evaluation samples must not enter the training cache
    values = []
    for batch in evaluation:
        logits = stages.stage_logits(batch)
        if stack.task == "classification":
            values.append(float((logits.argmax(-1) == batch["labels"]).float().mean()) * len(batch["labels"]))
        else:
            values.append(float(stack.loss(logits, batch)))
    stages.cache = saved
    for module in modules:
        module.train()
    total = sum(len(b["labels"]) for b in evaluation) if stack.task == "classification" else len(evaluation)
    return sum(values) / total


def retrain_last_block(name: str, stages: GreedyStages, draw: Batches, evaluation: list, steps: int, lr: float):
    """Re-initialise the last block and the model's head, then retrain only them: on the cached base (the cache that
    greedy training left, topped up on first sight) and on a base recomputed every step."""
    stack = stages.stack
    torch.manual_seed(SEED + 1)
    for module in [*stack.blocks[-1].modules(), *stack.final_head.modules()]:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    initial = copy.deepcopy([stack.blocks[-1].state_dict(), stack.final_head.state_dict()])
    cache, rows = stages.cache, []
    for cached in (True, False):
        stack.blocks[-1].load_state_dict(initial[0])
        stack.final_head.load_state_dict(initial[1])
        stages.cache = cache if cached else None
        stages.enter_stage(stages.num_stages - 1)
        start = time.perf_counter()
        _fit(stages.active_parameters(), stages.stage_loss, draw, steps, lr)
        seconds = time.perf_counter() - start
        stages.export_()
        rows.append({"model": name, "cached_base": cached, "steps": steps, "train_seconds": seconds,
                     **evaluate(stack.root, evaluation)})  # fmt: skip
    stages.cache = cache
    return rows


# ---------------------------------------------------------------------------------------------------- main
STEPS = {"cnn": 500, "vit": 150, "llama": 40, "lowbit_cnn": 500}
"""End-to-end optimizer steps per model (greedy: this many per block). Sized for 2 busy CPU cores."""
QUICK_STEPS = {"cnn": 4, "vit": 3, "llama": 2, "lowbit_cnn": 4}
LRS = {"cnn": 3e-3, "vit": 2e-3, "llama": 3e-3, "lowbit_cnn": 3e-3}
AUX = {"cnn": "linear", "vit": "linear", "llama": "lm_head", "lowbit_cnn": "linear"}
MODELS = tuple(STEPS)


def run_model(name: str, quick: bool) -> dict[str, Any]:
    """End-to-end, greedy (and for ViT / Llama: retrain the last block) for one model, in this process."""
    torch.set_num_threads(1)
    train, evaluation, vocab = text_data(quick) if name == "llama" else image_data(quick)
    batch_size, steps, lr = (16 if name == "llama" else 64), (QUICK_STEPS if quick else STEPS)[name], LRS[name]

    def fresh() -> Batches:  # the same seeded batch sequence for every run
        return _sampler(train, batch_size)

    e2e = end_to_end(name, make_model(name, vocab), fresh(), evaluation, steps, lr)
    print(json.dumps(e2e), flush=True)
    row, stages = greedy(name, make_model(name, vocab), fresh(), evaluation, steps, lr, AUX[name])
    print(json.dumps(row), flush=True)
    result: dict[str, Any] = {"end_to_end": e2e, "greedy": row, "retrain_last_block": []}
    if name in ("vit", "llama"):
        for entry in retrain_last_block(name, stages, fresh(), evaluation, steps, lr):
            entry["end_to_end_seconds"] = e2e["train_seconds"]
            print(json.dumps(entry), flush=True)
            result["retrain_last_block"].append(entry)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps, small data")
    parser.add_argument("--out", type=Path, default=OUT, help="directory of results.json and results.png")
    parser.add_argument("--workers", type=int, default=len(MODELS), help="models trained at once (1 thread each)")
    args = parser.parse_args()
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
        futures = {name: pool.submit(run_model, name, args.quick) for name in MODELS}
        runs = {name: future.result() for name, future in futures.items()}
    results: dict[str, Any] = {
        "git_revision": _git_revision(), "torch": torch.__version__, "machine": platform.machine(),
        "threads_per_run": 1, "parallel_runs": args.workers, "seed": SEED, "quick": args.quick,
        "steps": QUICK_STEPS if args.quick else STEPS, "learning_rates": LRS, "aux_heads": AUX,
        "end_to_end": [runs[n]["end_to_end"] for n in MODELS if n != "lowbit_cnn"],
        "greedy": [runs[n]["greedy"] for n in MODELS if n != "lowbit_cnn"],
        "retrain_last_block": [row for n in MODELS for row in runs[n]["retrain_last_block"]],
        "lowbit": {"end_to_end": runs["lowbit_cnn"]["end_to_end"], "greedy": runs["lowbit_cnn"]["greedy"],
                   "reference_end_to_end": _lowbit_reference()},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    if path.exists():  # keep other recipes' keys ("dgl", "pipeline")
        previous = json.loads(path.read_text())
        results = {**{k: v for k, v in previous.items() if k not in results}, **results}
    path.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "results.png")
    print(f"wrote {path}")


def _git_revision() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()


def _lowbit_reference() -> list[dict[str, Any]]:
    path = REPO / "docs" / "results" / "lowbit" / "results.json"
    if not path.exists():
        return []
    rows = json.loads(path.read_text()).get("classifiers", [])
    return [{**row, "source": "docs/results/lowbit/results.json"} for row in rows if row.get("model") == "cnn"]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["model"] for row in results["end_to_end"]] + ["lowbit_cnn"]
    e2e = [*results["end_to_end"], results["lowbit"]["end_to_end"]]
    gre = [*results["greedy"], results["lowbit"]["greedy"]]
    metric = [("accuracy" if "accuracy" in row else "val_loss") for row in e2e]
    fig, axes = plt.subplots(1, len(names), figsize=(3 * len(names), 3))
    for ax, name, a, b, key in zip(axes, names, e2e, gre, metric, strict=True):
        ax.bar(["end-to-end", "greedy"], [a[key], b[key]], color=["#777", "#3a7"])
        ax.set_title(f"{name}: {key}")
        if key == "accuracy":
            ax.set_ylim(min(a[key], b[key]) - 0.05, 1.0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
