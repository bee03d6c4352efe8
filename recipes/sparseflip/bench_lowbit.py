"""Low-bit training from seed 003, measured: accuracy / loss of fp32, STE and flip training, bytes per step of the
``sparseflip`` exchange against a dense fp32 all-reduce, the effect of the send threshold and the flip cap, and the
packed matmul against the fp32 one. Writes ``docs/results/lowbit/results.json`` (and ``results.png``).

    python recipes/sparseflip/bench_lowbit.py              # about 20 minutes on 2 CPU cores
    python recipes/sparseflip/bench_lowbit.py --quick      # a smoke run (minutes; figures not meaningful)
    python recipes/sparseflip/bench_lowbit.py --only bytes packing

Parts (each a key of the JSON):
- ``classifiers``: MLP and small CNN on MNIST-5k, one process (``recipes/sparseflip/lowbit_experiments.py``).
- ``distributed``: the CNN flip-trained by the strategy's runtime on 2 and 4 spawned gloo ranks; accuracy and the
  largest per-rank bytes per step, next to what a DDP fp32 all-reduce of the same model sends per rank.
- ``sweep``: the send threshold (``exchange.send_threshold_ratio``), the flip cap ``k`` and the seed's top-k rule,
  2 ranks.
- ``vit`` and ``llama``: the project's ViT on MNIST-5k and tiny Llama on Shakespeare through the Lightning Trainer:
  fp32, STE ternary and ``SparseFlipStrategy`` (one process).
- ``bytes``: ViT-tiny on 2 and 4 ranks, dense vs sparse fp averaging, per-rank bytes per step.
- ``packing``: packed +/-1 matmul (XOR/AND + popcount) vs fp32 ``torch.matmul``, and packed file sizes.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lowbit_workers  # noqa: E402  (the spawned-rank workers live next to this script)

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "results" / "lowbit"
PARTS = ("classifiers", "distributed", "sweep", "vit", "llama", "bytes", "packing")


def classifiers(steps: int) -> list[dict[str, Any]]:
    from lowbit_experiments import train_classifier

    rows = []
    for model in ("mlp", "cnn"):
        for method in ("fp32", "ste_ternary", "flip_ternary", "flip_binary"):
            row = train_classifier(model, "mnist", method, steps=steps, seed=0)
            rows.append({k: row[k] for k in ("model", "dataset", "method", "steps", "accuracy", "train_seconds")})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def distributed(steps: int) -> list[dict[str, Any]]:
    rows = []
    for workers in (2, 4):
        row = lowbit_workers.train_distributed(workers, "cnn", "mnist", steps, {})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sweep(steps: int) -> list[dict[str, Any]]:
    settings = [  # SparseFlipSettings fields, nested as in a YAML init_args.settings
        {"exchange": {"send_threshold_ratio": 0.5}},
        {"exchange": {"send_threshold_ratio": 2.0}},
        {"flip": {"max_per_step": 10}},
        {"exchange": {"encoding": "bf16"}},
        # the seed's rule, k = 0.1% of the codes
        {"flip": {"rule": "topk"}, "exchange": {"kept_fraction": 0.01, "encoding": "bf16"}},
        {"flip": {"rule": "topk", "max_fraction": 0.01}, "exchange": {"kept_fraction": 0.1, "encoding": "bf16"}},
    ]
    rows = []
    for options in settings:
        row = lowbit_workers.train_distributed(2, "cnn", "mnist", steps, options)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _trainer_run(kind: str, method: str, max_steps: int) -> dict[str, Any]:
    """One Trainer fit in a subprocess (fresh process: no state shared between methods)."""
    command = [sys.executable, __file__, "--trainer-run", kind, method, str(max_steps)]
    output = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO).stdout
    return json.loads(output.strip().splitlines()[-1])


def trainer_run(kind: str, method: str, max_steps: int) -> dict[str, Any]:
    """In this process: fit the project's ViT (MNIST-5k) or tiny Llama (Shakespeare) with ``method``."""
    import lightning as L

    from lightning_hetero import SparseFlipStrategy
    from lightning_hetero.data import MNISTDataModule, ShakespeareDataModule
    from lightning_hetero.models import CausalLMModule, ImageClassifierModule
    from lightning_hetero.sparseflip import SparseFlipSettings, convert_model

    base = ImageClassifierModule if kind == "vit" else CausalLMModule

    class SteModule(base):  # type: ignore[misc, valid-type]
        def configure_model(self) -> None:
            super().configure_model()
            convert_model(self.model, "ternary", "ste", "row")  # heads and embeddings stay fp, as with flips

    L.seed_everything(0, verbose=False)
    if kind == "vit":
        data = MNISTDataModule(batch_size=64, val_fraction=0.1)
        arguments = {"preset": "vit-tiny", "config": {"patch_size": 7}, "learning_rate": 2e-3, "warmup_steps": 20}
    else:
        data = ShakespeareDataModule(seq_len=128, batch_size=16, vocab_size=2048, val_fraction=0.05)
        arguments = {"preset": "llama-tiny", "learning_rate": 3e-3, "warmup_steps": 25}
    module = (SteModule if method == "ste_ternary" else base)(**arguments)
    strategy: Any = "auto"
    if method.startswith("flip"):
        strategy = SparseFlipStrategy(SparseFlipSettings(kind=method.split("_")[1]))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1.0 if kind == "vit" else 20,
        val_check_interval=None if kind == "vit" else max_steps,
        check_val_every_n_epoch=None if kind == "llama" else 10**6,
    )
    start = time.perf_counter()
    trainer.fit(module, data)
    seconds = time.perf_counter() - start
    metrics = trainer.validate(module, data, verbose=False)[0]
    return {"model": kind, "method": method, "steps": max_steps, "seconds": seconds, **metrics}


def bytes_per_step(steps: int) -> list[dict[str, Any]]:
    rows = []
    for workers in (2, 4):
        for options in ({}, {"fp_sync": {"kept_fraction": 0.05}}):
            row = lowbit_workers.measure(workers, options, steps=steps)
            row.pop("ranks")
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def packing() -> dict[str, Any]:
    import tempfile

    from torch import nn

    from lightning_hetero.sparseflip import convert_model, packed_matmul, save_packed

    generator = torch.Generator().manual_seed(0)
    a = torch.randint(0, 2, (256, 1024), generator=generator).float() * 2 - 1
    w = torch.randint(-1, 2, (1024, 1024), generator=generator).float()
    exact = bool(torch.equal(packed_matmul(a, w), (a @ w.T).long()))

    def timed(fn: Any, repeats: int = 5) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats

    packed_seconds = timed(lambda: packed_matmul(a, w))
    fp32_seconds = timed(lambda: a @ w.T)
    model = convert_model(
        nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)), "ternary", "flip", "row", skip=()
    )
    sizes = {}
    with tempfile.TemporaryDirectory() as folder:
        for layout in ("2bit", "base3"):
            path = Path(folder) / f"{layout}.safetensors"
            save_packed(model, path, ternary_format=layout)
            sizes[layout] = path.stat().st_size
    return {
        "matmul_shape": [256, 1024, 1024],
        "packed_equals_float": exact,
        "packed_matmul_seconds": packed_seconds,
        "fp32_matmul_seconds": fp32_seconds,
        "packed_over_fp32_time": packed_seconds / fp32_seconds,
        "file_bytes_2x1024x1024_ternary": sizes,
        "fp32_bytes_same_weights": 2 * 1024 * 1024 * 4,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = results.get("distributed", []) + results.get("sweep", [])
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        label = f"{row['workers']}w {json.dumps(row['options'])}"
        ax.scatter(row["bytes_ratio_vs_dense"], row["accuracy"], label=label)
    single = [r for r in results.get("classifiers", []) if r["model"] == "cnn" and r["method"] == "fp32"]
    if single:
        ax.axhline(single[0]["accuracy"], color="grey", linestyle="--", label="fp32, one process")
    ax.set_xscale("log")
    ax.set_xlabel("fewer bytes per step than a dense fp32 all-reduce (x)")
    ax.set_ylabel("MNIST-5k test accuracy (CNN)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps: checks the recipe runs, not the figures")
    parser.add_argument("--only", nargs="*", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--trainer-run", nargs=3, metavar=("MODEL", "METHOD", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer_run:
        print(json.dumps(trainer_run(args.trainer_run[0], args.trainer_run[1], int(args.trainer_run[2]))))
        return
    steps = 20 if args.quick else 2000
    results: dict[str, Any] = {
        "git_revision": subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "seed": 0,
        "quick": args.quick,
    }
    if "classifiers" in args.only:
        results["classifiers"] = classifiers(steps)
    if "distributed" in args.only:
        results["distributed"] = distributed(steps)
    if "sweep" in args.only:
        results["sweep"] = sweep(steps)
    for kind, max_steps in (("vit", 30 if args.quick else 350), ("llama", 20 if args.quick else 300)):
        if kind in args.only:
            methods = ("fp32", "ste_ternary", "flip_ternary") + (("flip_binary",) if kind == "llama" else ())
            results[kind] = [_trainer_run(kind, method, max_steps) for method in methods]
            print(json.dumps(results[kind]), flush=True)
    if "bytes" in args.only:
        results["bytes"] = bytes_per_step(2 if args.quick else 4)
    if "packing" in args.only:
        results["packing"] = packing()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "results.png")
    print(json.dumps({k: v for k, v in results.items() if k != "classifiers"}, indent=1))


if __name__ == "__main__":
    main()
