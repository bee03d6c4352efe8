"""Work for the cgroup self-test, run by file path (``python .../burn.py``) so it imports nothing but the stdlib.

    python burn.py cpu --seconds 3          # a pure-Python busy loop; prints {"iterations", "seconds", "rate"}
    python burn.py memory --bytes 268435456 # touch that much memory, 8 MiB at a time; prints {"allocated_bytes"}

Any slowness or death comes from the kernel's limits on the process's cgroup: the loop never sleeps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_CHUNK_BYTES = 8 * 2**20
_PAGE_BYTES = 4096
_ITERATIONS_PER_CHECK = 10_000


def burn_cpu(seconds: float) -> dict[str, float]:
    """Count loop iterations for ``seconds`` of wall time; the rate is the CPU share this process got."""
    iterations = 0
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        for _ in range(_ITERATIONS_PER_CHECK):
            pass
        iterations += _ITERATIONS_PER_CHECK
    return {"iterations": iterations, "seconds": elapsed, "rate": iterations / elapsed}


def burn_memory(total_bytes: int) -> dict[str, int]:
    """Allocate ``total_bytes`` and write one byte per page, so every page is really resident (and charged)."""
    chunks = []
    allocated = 0
    while allocated < total_bytes:
        chunk = bytearray(min(_CHUNK_BYTES, total_bytes - allocated))
        for offset in range(0, len(chunk), _PAGE_BYTES):
            chunk[offset] = 1
        chunks.append(chunk)
        allocated += len(chunk)
        print(json.dumps({"progress_bytes": allocated}), flush=True)
    return {"allocated_bytes": allocated}


def main(argv: list[str] | None = None) -> int:
    """Run one kind of work and print its JSON result line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kinds = parser.add_subparsers(dest="kind", required=True)
    cpu = kinds.add_parser("cpu")
    cpu.add_argument("--seconds", type=float, default=3.0)
    cpu.add_argument("--pin", type=int, default=None, help="run on this CPU only (sched_setaffinity)")
    kinds.add_parser("memory").add_argument("--bytes", type=int, required=True)
    args = parser.parse_args(argv)
    if args.kind == "cpu" and args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    result = burn_cpu(args.seconds) if args.kind == "cpu" else burn_memory(args.bytes)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
