"""A tiny gloo workload for testing the testbed: counted all_reduces, verified, then exit (the ledger dumps itself).

    python -m lightning_hetero.testbed.probe --numel 1000000 --steps 3 [--label inter] [--fail-rank 1]

Every rank initialises gloo from the torchrun-style environment the testbed sets, and for each step sets the ledger
step and all_reduces a float32 tensor of ``numel`` elements filled with ``rank + 1 + step`` through
:func:`lightning_hetero.comm.all_reduce`, then checks every element. ``--fail-rank R`` makes rank R exit with
``--fail-code`` (default 3) right after joining the group, to exercise failure handling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    """Run the probe; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_hetero.testbed.probe", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--numel", type=int, default=1_000_000, help="float32 elements per all_reduce")
    parser.add_argument("--steps", type=int, default=3, help="all_reduces, one per ledger step")
    parser.add_argument("--label", default="inter", help="ledger label of the all_reduces")
    parser.add_argument("--fail-rank", type=int, default=None, help="this rank exits right after joining the group")
    parser.add_argument("--fail-code", type=int, default=3, help="exit code of --fail-rank")
    parser.add_argument("--timeout", type=float, default=120.0, help="process group timeout in seconds")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from lightning_hetero import comm

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == args.fail_rank:
        print(f"rank {rank}: failing on purpose with exit code {args.fail_code}", flush=True)
        return args.fail_code
    ledger = comm.get_ledger()
    seconds = []
    for step in range(args.steps):
        ledger.set_step(step)
        tensor = torch.full((args.numel,), float(rank + 1 + step), dtype=torch.float32)
        start = time.perf_counter()
        comm.all_reduce(tensor, label=args.label)
        seconds.append(time.perf_counter() - start)
        expected = float(sum(r + 1 + step for r in range(world_size)))
        if not bool(torch.all(tensor == expected)):
            print(f"rank {rank}: step {step} all_reduce gave {tensor[:4].tolist()}..., expected {expected}")
            return 1
    dist.destroy_process_group()
    summary = {"rank": rank, "world_size": world_size, "payload_bytes": 4 * args.numel, "seconds": seconds}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
