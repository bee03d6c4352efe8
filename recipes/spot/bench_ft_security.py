"""What membership and the update checks cost an honest spot run (issue 33): HMAC throughput and the gradient exchange.

Two replica groups as threads of this process on a live lighthouse (gloo on CPU). Per gradient size it times, in
alternation over the same quorum, the authenticated exchange that ``FaultTolerantReplica.average_gradients`` runs now
(all-gather of ``payload || 32-byte tag``, tags verified, contributions checked and summed in slot order) and the
exchange it ran before (``manager.allreduce`` AVG, unchecked), and reports the medians, plus HMAC-SHA256 throughput.
Prints one JSON document (``--out`` writes it too)::

    python recipes/spot/bench_ft_security.py [--sizes 161 262144 1048576] [--repeats 30]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch


def hmac_throughput(megabytes: int = 16, repeats: int = 5) -> float:
    """MB/s of HMAC-SHA256 over ``megabytes`` of data (best of ``repeats``)."""
    data = bytes(megabytes << 20)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        hmac.new(b"k" * 32, data, hashlib.sha256).digest()
        best = min(best, time.perf_counter() - start)
    return megabytes / best


def _replica(address: str, index: int, sizes: list[int], repeats: int, barrier: threading.Barrier) -> dict[str, Any]:
    from torch.distributed import ReduceOp

    from lightning_hetero.ft.replicas import FaultTolerantReplica
    from lightning_hetero.ft.settings import FaultToleranceSettings

    model = torch.nn.Linear(2, 2)
    settings = FaultToleranceSettings(
        lighthouse=address, min_replicas=2, replica_id_source="fixed", replica_id=f"b{index}", timeout_s=30
    )
    replica = FaultTolerantReplica(
        settings, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), store_host="localhost"
    )
    times: dict[str, dict[str, list[float]]] = {}
    try:
        replica.start_step()
        for size in sizes:
            flat = torch.randn(size, generator=torch.Generator().manual_seed(index))
            entry = times.setdefault(str(size), {"checked": [], "unchecked": []})
            for _ in range(repeats):
                for name in ("checked", "unchecked"):
                    tensor = flat.clone()
                    barrier.wait()
                    start = time.perf_counter()
                    if name == "checked":
                        replica.allreduce_(tensor, "mean")
                    else:
                        replica.manager.allreduce(tensor, reduce_op=ReduceOp.AVG).wait()
                    entry[name].append(time.perf_counter() - start)
        assert replica.manager.errored() is None, replica.manager.errored()
        return times
    finally:
        replica.shutdown()


def run(sizes: list[int], repeats: int) -> dict[str, Any]:
    from torchft.coordination import LighthouseServer

    torch.set_num_threads(1)  # two replicas share this process (and 2 cores): no intra-op oversubscription

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=300)
    barrier = threading.Barrier(2)
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_replica, lighthouse.address(), i, sizes, repeats, barrier) for i in range(2)]
            results = [future.result() for future in futures]
    finally:
        lighthouse.shutdown()
    rows = []
    for size in sizes:
        checked = statistics.median(t for r in results for t in r[str(size)]["checked"])
        unchecked = statistics.median(t for r in results for t in r[str(size)]["unchecked"])
        rows.append(
            {
                "floats": size,
                "payload_bytes": 4 * size,
                "checked_ms": round(1e3 * checked, 3),
                "unchecked_ms": round(1e3 * unchecked, 3),
                "added_ms": round(1e3 * (checked - unchecked), 3),
                "wire_bytes_checked": 4 * size + 32,  # (n - 1)(S + 32) with n = 2
                "wire_bytes_unchecked": 4 * size,  # 2 (n - 1) S / n with n = 2
            }
        )
    return {
        "command": f"python recipes/spot/bench_ft_security.py --sizes {' '.join(map(str, sizes))} --repeats {repeats}",
        "replicas": 2,
        "hmac_sha256_mb_per_s": round(hmac_throughput(), 1),
        "exchange": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[161, 262_144, 1_048_576])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = run(args.sizes, args.repeats)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
