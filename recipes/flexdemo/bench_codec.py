"""Cost of the DeMo codec per optimizer step, phase by phase, on a model preset's parameter shapes.

FlexDeMo's step on a slow link is compute + codec when the exchange is hidden (docs/flexdemo.md, "Link-bound tuning
sweep"). This times the codec alone on random tensors of every parameter shape of ``--preset`` (unsharded, as with
one rank per node): the chunked DCT, the top-k of the coefficients, the inverse DCT, and the replicator's whole
``encode`` (transform, top-k, packing, error feedback) and ``decode_gathered`` (``--replicas`` payloads summed,
inverse transform). Best of ``--repeats``; CUDA timings synchronize the device.

    python recipes/flexdemo/bench_codec.py --vocab-size 2048  # llama-medium as in the sweep, CPU, 1 thread: ~15 s
    python recipes/flexdemo/bench_codec.py --device cuda --threads 0        # the same on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "recipes" / name) for name in ("flexdemo", "common")]  # siblings, shared helpers

import torch  # noqa: E402
from headline import run_metadata  # noqa: E402

from lightning_hetero.models import build_config  # noqa: E402
from lightning_hetero.replication import build_replicator  # noqa: E402
from lightning_hetero.replication.transforms import ChunkedDCT  # noqa: E402


def parameter_shapes(preset: str, vocab_size: int | None = None) -> list[tuple[int, ...]]:
    """Every parameter shape of ``preset``'s model (built on the meta device: no memory, no values)."""
    from transformers import AutoModelForCausalLM

    overrides = {"vocab_size": vocab_size} if vocab_size else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(preset, overrides))
    return [tuple(parameter.shape) for parameter in model.parameters()]


def best_seconds(function: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up call."""
    function()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per optimizer step of each codec phase over all parameters of the preset."""
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = parameter_shapes(args.preset, args.vocab_size)
    tensors = [torch.randn(shape, device=device) for shape in shapes]
    replicator = build_replicator("demo", args.kept_fraction, chunk=args.chunk, values=args.values)
    dct = ChunkedDCT(args.chunk)
    coefficients = [dct.encode(tensor) for tensor in tensors]
    kept = [replicator._sizes(tensor.shape)[2] for tensor in tensors]
    pieces = [replicator.encode(key, tensor.clone()) for key, tensor in enumerate(tensors)]

    def top_k() -> None:
        for rows, k in zip(coefficients, kept, strict=True):
            if rows.numel():
                torch.topk(rows.abs(), k, dim=1, sorted=False)

    phases = {
        "dct": lambda: [dct.encode(tensor) for tensor in tensors],
        "top_k": top_k,
        "inverse_dct": lambda: [dct.decode(rows, t.shape) for rows, t in zip(coefficients, tensors, strict=True)],
        "encode": lambda: [replicator.encode(key, tensor.clone()) for key, tensor in enumerate(tensors)],
        "decode_gathered": lambda: [replicator.decode_gathered(p, [p.wire] * args.replicas) for p in pieces],
        "clone_only": lambda: [tensor.clone() for tensor in tensors],  # subtracted from encode: its input copies
    }
    seconds = {name: best_seconds(function, args.repeats, device) for name, function in phases.items()}
    per_step = seconds["encode"] - seconds["clone_only"] + seconds["decode_gathered"]
    return {
        "meta": run_metadata(),
        "preset": args.preset,
        "vocab_size": args.vocab_size,
        "parameters": sum(tensor.numel() for tensor in tensors),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "replicator": replicator.describe(),
        "replicas": args.replicas,
        "repeats": args.repeats,
        "wire_bytes_per_step": sum(piece.wire.numel() for piece in pieces),
        "seconds": {name: round(value, 4) for name, value in seconds.items()},
        "codec_seconds_per_step": round(per_step, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-medium", help="model preset whose parameter shapes are coded")
    parser.add_argument("--vocab-size", type=int, help="override the preset's (the benchmarks' Shakespeare BPE: 2048)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--kept-fraction", type=float, default=1 / 32)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--values", default="sign", choices=["fp32", "bf16", "sign", "ternary"])
    parser.add_argument("--replicas", type=int, default=2, help="payloads combined by decode_gathered")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here; use --device cpu")
    if args.replicas < 1 or args.repeats < 1:
        parser.error("--replicas and --repeats must be >= 1")
    result = measure(args)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
