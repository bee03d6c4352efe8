"""Mid-epoch resume, per strategy: stop at step 7 of a 20-step epoch, resume, compare with an uninterrupted run.

For every case of :data:`lightning_hetero.testing.resume.CASES` (FlexDeMo with the DeMo and the DiLoCo replicator,
MatFormer with mixed tiers and DeMo-compressed sync, the subspace pipeline, SparseFlip low-bit) this spawns 2 gloo
ranks on CPU and runs three Trainer fits: straight (20 steps = one shuffled epoch), stopped (checkpoint at step 7,
then stop) and resumed (fresh Trainer from that checkpoint to step 20). A case counts as a bit-identical resume when,
on every rank, the resumed fit trained on exactly the straight fit's batches 8-20 and its final parameters, optimizer
state and strategy state equal the straight fit's bit for bit. Same check as ``tests/dist/test_midepoch_resume.py``.

    python recipes/reliability/reliability_resume.py   # writes docs/results/reliability_resume.json (1-5 min a case)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from lightning_hetero.testing import run_distributed
from lightning_hetero.testing.resume import CASES, resume_case

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "docs" / "results" / "reliability_resume.json"


def run(case: str, stop: int, steps: int) -> dict[str, object]:
    """One case on 2 spawned ranks: the per-rank verdicts folded into one row."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="reliability_resume_") as scratch:
        ranks = run_distributed(resume_case, 2, case, Path(scratch), stop, steps, timeout=1200)
    strategy, variant = case.split("/")
    return {
        "strategy": strategy,
        "variant": variant,
        "stop_step": stop,
        "steps": steps,
        "equal": all(r["equal"] and r["same_batches"] for r in ranks),
        "max_abs_diff": max(r["max_abs_diff"] for r in ranks),
        "same_batches": all(r["same_batches"] for r in ranks),
        "restart_would_differ": all(r["restart_would_differ"] for r in ranks),
        "differing": sorted({key for r in ranks for key in r["differing"]})[:10],
        "compared_per_rank": [r["compared"] for r in ranks],
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=sorted(CASES), choices=sorted(CASES), help="cases to run")
    parser.add_argument("--stop", type=int, default=7, help="step at which the interrupted run stops")
    parser.add_argument("--steps", type=int, default=20, help="steps of the epoch (and of the run)")
    parser.add_argument("--result", default=str(RESULT), help="where the JSON goes")
    args = parser.parse_args()
    if not 0 < args.stop < args.steps:
        parser.error(f"--stop must be between 1 and --steps - 1 (mid-epoch), got {args.stop} with --steps {args.steps}")
    cases = []
    for case in args.cases:
        cases.append(run(case, args.stop, args.steps))
        print(json.dumps(cases[-1]), flush=True)
    result = {
        "command": "python recipes/reliability/reliability_resume.py",
        "bit_identical_resumes": sum(case["equal"] for case in cases),
        "cases": cases,
        "setup": "2 spawned gloo ranks on CPU per case; tiny Llama (2 layers, hidden 32) or an MLP (sparseflip); "
        "StatefulDataLoader shuffling; data-parallel replicas get a DistributedSampler injected by the Trainer",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['bit_identical_resumes']}/{len(cases)} bit-identical resumes -> {args.result}")


if __name__ == "__main__":
    main()
