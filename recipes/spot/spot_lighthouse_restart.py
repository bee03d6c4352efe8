"""The lighthouse dies and comes back on the same address: do the replica groups survive, and what does it cost?

Starts ``torchft_lighthouse`` on a fixed port, 2 replica groups (``recipes/spot/spot_worker.py``, gloo), waits until
they commit steps together, kills the lighthouse (SIGKILL), waits ``--outage`` seconds, starts it again on the same
address and waits for the replicas to commit again. Prints one JSON line:

- ``outage_s``: how long the lighthouse was down; ``stall_s``: the longest gap between two commits of a replica around
  the outage; ``survivor_restarts``: worker processes that died or changed pid (target 0);
- ``steps_lost``: committed steps missing from the replicas' logs (target 0); ``steps_after``: commits after the
  restart; ``identical_at_end``: both replicas' weights equal at the end; ``quorum_retries`` / ``quorum_timeout_s``:
  the settings used (``quorum_retries`` None: the setting's default).

    python recipes/spot/spot_lighthouse_restart.py --outage 60          # about outage + 30 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from lightning_hetero.testing import find_free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "recipes" / "spot" / "spot_worker.py"
LIGHTHOUSE_FLAGS = ("--min_replicas", "2", "--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1500")
"""The flags of docs/spot.md's production lighthouse (the spot recipe's tuned timeouts)."""


def start_lighthouse(port: int, log: Path) -> subprocess.Popen:
    """``torchft_lighthouse`` bound to ``port`` (all interfaces), output appended to ``log``."""
    command = ["torchft_lighthouse", "--bind", f"[::]:{port}", *LIGHTHOUSE_FLAGS]
    env = {**os.environ, "RUST_LOG": "warn"}
    return subprocess.Popen(command, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT)


def commits(out: Path, node: int) -> list[dict[str, Any]]:
    """The committed-step records a worker wrote so far."""
    path = out / f"replica_{node}.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return [record for record in map(json.loads, lines) if not record.get("final")]


def wait_for(condition: Any, what: str, procs: dict[int, subprocess.Popen], timeout: float) -> None:
    """Poll ``condition`` until true; raise if a worker exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for node, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"worker {node} exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def run(out: Path, outage: float, quorum_retries: int | None, quorum_timeout: float) -> dict[str, Any]:
    """One lighthouse outage of ``outage`` seconds under 2 workers; returns the measured fields."""
    port = find_free_port()
    address = f"http://localhost:{port}"
    lighthouse_log = out / "lighthouse.log"
    lighthouse = start_lighthouse(port, lighthouse_log)
    procs: dict[int, subprocess.Popen] = {}
    try:
        for node in (0, 1):
            command = [sys.executable, str(WORKER), "--lighthouse", address, "--replica-id", str(node)]
            command += ["--out", str(out), "--quorum-timeout", str(quorum_timeout)]
            if quorum_retries is not None:
                command += ["--quorum-retries", str(quorum_retries)]
            log = (out / f"worker_{node}.log").open("w")
            env = {**os.environ, "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
            env.pop("TORCHFT_QUORUM_RETRIES", None)  # the setting under test, not the environment
            procs[node] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_for(lambda: all(len(commits(out, n)) >= 10 for n in procs), "10 commits each", procs, 180)
        pids = {n: commits(out, n)[-1]["pid"] for n in procs}
        lighthouse.send_signal(signal.SIGKILL)
        lighthouse.wait()
        killed_at = time.time()
        time.sleep(outage)
        lighthouse = start_lighthouse(port, lighthouse_log)
        restarted_at = time.time()
        before = {n: len(commits(out, n)) for n in procs}
        wait_for(
            lambda: all(len(commits(out, n)) >= before[n] + 5 for n in procs),
            "5 commits each after the restart",
            procs,
            quorum_timeout * ((quorum_retries or 0) + 1) + outage + 120,
        )
        stop = max(r["step"] for n in procs for r in commits(out, n)) + 2
        (out / "stop").write_text(str(stop))
        codes = {n: proc.wait(timeout=120) for n, proc in procs.items()}
        records = {n: commits(out, n) for n in procs}
        stall = 0.0
        for node_records in records.values():
            times = [r["time"] for r in node_records]
            gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > killed_at - 5]
            stall = max([stall, *gaps])
        finals = []
        for node in procs:
            lines = (out / f"replica_{node}.jsonl").read_text().splitlines()
            finals += [json.loads(line) for line in lines if line.strip().endswith("}") and '"final"' in line]
        steps = set()
        for node_records in records.values():
            steps.update(r["step"] for r in node_records)
        return {
            "outage_s": round(restarted_at - killed_at, 2),
            "stall_s": round(stall, 2),
            "survivor_restarts": sum(1 for n in procs if codes[n] != 0 or {r["pid"] for r in records[n]} != {pids[n]}),
            "steps_lost": len(set(range(1, max(steps) + 1)) - steps),
            "steps_after": min(len(records[n]) - before[n] for n in procs),
            "identical_at_end": len(finals) == len(procs) and len({f["digest"] for f in finals}) == 1,
            "final_step": stop,
            "quorum_retries": quorum_retries,
            "quorum_timeout_s": quorum_timeout,
        }
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if lighthouse.poll() is None:
            lighthouse.kill()
            lighthouse.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage", type=float, default=10.0, help="seconds the lighthouse stays down")
    parser.add_argument("--quorum-retries", type=int, default=None, help="default: FaultToleranceSettings'")
    parser.add_argument("--quorum-timeout", type=float, default=30.0, help="FaultToleranceSettings.quorum_timeout_s")
    parser.add_argument("--out", type=Path, default=None, help="keep the logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    with TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        result = run(out, args.outage, args.quorum_retries, args.quorum_timeout)
    print(json.dumps(result))
    ok = result["survivor_restarts"] == 0 and result["steps_lost"] == 0 and result["identical_at_end"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
