"""Spot-worker fault recipe on localhost: a torchft lighthouse and 3 replica groups (recipes/spot_worker.py, gloo).

Starts the lighthouse itself (``torchft_lighthouse``), runs 3 replica processes, kills one with SIGKILL three times
(restarting it each time) and freezes one with SIGSTOP past the collective timeout (then SIGCONT); every rejoin is
healed from a live peer through the pickle-free transport (the workers run with ``--forbid-pickle``). Then it runs
the same schedule without faults for the reference loss, stops the lighthouse and writes ``docs/results/spot.json``:

- ``engine``, ``nodes``, ``kills``, ``sigstops``, ``rejoins``;
- ``survivor_restarts``: processes of a node that was not the victim that changed pid (target 0);
- ``survivor_steps_lost``: committed steps missing from the union of all replicas' logs (target 0);
- ``max_stall_s``: per fault, the longest time between two commits of the survivors around it (target: at most
  the configured timeout + 2 s), and ``max_stall_s_overall``;
- ``rejoined_bit_identical``: every rejoined replica's weights equal its peers' after its first step;
- ``val_loss_gap_pct``: final validation loss against a run without faults on the same tokens (one process replays
  exactly the batches the faulty run committed, step by step); ``val_loss_gap_pct_vs_all_replicas`` against a run
  of the same steps where all 3 replicas take part in every step (more tokens: the missing nodes' batches);
- ``pickle_free_transport``, ``git_revision``, ``timeout_s``, ``steps``, ``faults``.

    python recipes/spot_recipe.py                      # ~2-4 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "recipes" / "spot_worker.py"
NODES = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _records(out: Path, node: int) -> list[dict]:
    path = out / f"replica_{node}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _steps(out: Path, node: int) -> list[dict]:
    return [r for r in _records(out, node) if not r.get("final")]


def _wait(condition, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


class Run:
    """One run's worker processes."""

    def __init__(self, lighthouse: str, out: Path, timeout_s: float) -> None:
        self.lighthouse, self.out, self.timeout_s = lighthouse, out, timeout_s
        self.procs: dict[int, subprocess.Popen] = {}
        out.mkdir(parents=True, exist_ok=True)

    def start(self, node: int) -> None:
        log = (self.out / f"worker_{node}_{time.monotonic_ns()}.log").open("w")
        command = [sys.executable, str(WORKER), "--lighthouse", self.lighthouse, "--replica-id", str(node)]
        command += ["--out", str(self.out), "--timeout", str(self.timeout_s), "--forbid-pickle"]
        env = {**os.environ, "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
        self.procs[node] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def committed(self, node: int, participants: int | None = None, after: float = 0.0) -> int:
        return len(
            [
                r
                for r in _steps(self.out, node)
                if r["time"] > after and (participants is None or r["participants"] == participants)
            ]
        )

    def stop_at(self, step: int) -> None:
        (self.out / "stop").write_text(str(step))
        for node, proc in self.procs.items():
            if proc.wait(timeout=300) != 0:
                raise RuntimeError(f"worker {node} exited with {proc.returncode}; see {self.out}")

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
                proc.kill()
                proc.wait()


def _check_rejoin(run: Run, node: int, after: float) -> dict:
    """The node's first commit after ``after`` and whether its weights equal every peer's at that step."""
    _wait(lambda: run.committed(node, after=after) > 0, f"node {node} to commit after rejoining")
    first = next(r for r in _steps(run.out, node) if r["time"] > after)
    peers = [n for n in range(NODES) if n != node]
    _wait(lambda: all(any(r["step"] == first["step"] for r in _steps(run.out, p)) for p in peers), "peers")
    same = all(
        next(r for r in _steps(run.out, p) if r["step"] == first["step"])["digest"] == first["digest"] for p in peers
    )
    return {
        "node": node,
        "rejoined_at_step": first["step"],
        "participants": first["participants"],
        "bit_identical": same,
    }


def _stall(run: Run, survivors: list[int], start: float, end: float) -> float:
    """Longest gap between consecutive commits of any survivor within ``[start, end]`` (incl. the edges)."""
    worst = 0.0
    for node in survivors:
        times = [start] + [r["time"] for r in _steps(run.out, node) if start < r["time"] < end] + [end]
        worst = max(worst, max(b - a for a, b in zip(times, times[1:], strict=False)))
    return worst


def faulty_run(lighthouse: str, out: Path, timeout_s: float) -> dict:
    run = Run(lighthouse, out, timeout_s)
    faults, pids_expected = [], {n: 1 for n in range(NODES)}
    try:
        for node in range(NODES):
            run.start(node)
        _wait(lambda: all(run.committed(n, 3) >= 10 for n in range(NODES)), "3 nodes to commit 10 steps together")
        for victim, how in ((2, "SIGKILL"), (1, "SIGKILL"), (2, "SIGKILL"), (1, "SIGSTOP")):
            survivors = [n for n in range(NODES) if n != victim]
            fault_at = time.time()
            if how == "SIGKILL":
                run.procs[victim].send_signal(signal.SIGKILL)
                run.procs[victim].wait()
            else:
                run.procs[victim].send_signal(signal.SIGSTOP)
            _wait(
                lambda s=survivors, t=fault_at: all(run.committed(n, 2, after=t) >= 5 for n in s),
                f"survivors to commit 5 steps without node {victim}",
            )
            back_at = time.time()
            if how == "SIGKILL":
                run.start(victim)
                pids_expected[victim] += 1
            else:
                run.procs[victim].send_signal(signal.SIGCONT)
            rejoin = _check_rejoin(run, victim, back_at)
            _wait(lambda t=back_at: all(run.committed(n, 3, after=t) >= 3 for n in range(NODES)), "3 nodes again")
            stall = _stall(run, survivors, fault_at, back_at)
            faults.append({"victim": victim, "signal": how, "stall_s": round(stall, 3), **rejoin})
            print(f"fault {len(faults)}: {how} node {victim}: stall {stall:.2f} s, rejoin {rejoin}", flush=True)
        last = max(r["step"] for n in range(NODES) for r in _steps(out, n))
        run.stop_at(last + 10)
    finally:
        run.kill_all()
    finals = [next(r for r in _records(out, n) if r.get("final")) for n in range(NODES)]
    committed = {r["step"] for n in range(NODES) for r in _steps(out, n)}
    restarts = sum(len({r["pid"] for r in _steps(out, n)}) - pids_expected[n] for n in range(NODES))
    return {
        "faults": faults,
        "final_step": finals[0]["step"],
        "final_val_loss": finals[0]["val_loss"],
        "final_identical": len({f["digest"] for f in finals}) == 1,
        "survivor_restarts": restarts,
        "survivor_steps_lost": len(set(range(1, max(committed) + 1)) - committed),
    }


def same_tokens_reference(out: Path) -> tuple[float, int, int]:
    """A one-process run without faults on exactly the batches the faulty run committed: its validation loss, and
    at how many of the committed steps its weights equal the faulty run's bit for bit (of how many)."""
    sys.path.insert(0, str(WORKER.parent))
    import spot_worker

    committed: dict[int, list[dict]] = {}
    for node in range(NODES):
        for record in _steps(out, node):
            committed.setdefault(record["step"], []).append({**record, "node": node})
    schedule = []
    for step, records in sorted(committed.items()):
        nodes = sorted(r["node"] for r in records)
        if max(r["participants"] for r in records) == NODES:  # a node killed right after the exchange left no record
            nodes = list(range(NODES))
        schedule.append((step, nodes))
    equal = []

    def compare(step: int, model: Any) -> None:
        equal.append(spot_worker.digest(model) in {r["digest"] for r in committed[step]})

    model = spot_worker.replay(schedule, on_step=compare)
    return spot_worker.validation_loss(model), sum(equal), len(equal)


def reference_run(lighthouse: str, out: Path, timeout_s: float, steps: int) -> float:
    run = Run(lighthouse, out, timeout_s)
    try:
        (out / "stop").write_text(str(steps))
        for node in range(NODES):
            run.start(node)
        run.stop_at(steps)
    finally:
        run.kill_all()
    return next(r for r in _records(out, 0) if r.get("final"))["val_loss"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "spot.json")
    parser.add_argument("--timeout", type=float, default=5.0, help="collective timeout of the replicas (s)")
    parser.add_argument("--work", type=Path, default=None, help="keep the workers' logs here (default: a temp dir)")
    args = parser.parse_args()
    port = _free_port()
    lighthouse_command = ["torchft_lighthouse", "--min_replicas", "2", "--bind", f"[::]:{port}"]
    lighthouse_command += ["--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1500", "--quorum_tick_ms", "100"]
    lighthouse = subprocess.Popen(lighthouse_command, env={**os.environ, "RUST_LOG": "warn"})
    address = f"http://localhost:{port}"
    started = time.time()
    revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    try:
        with TemporaryDirectory() as tmp:
            work = args.work or Path(tmp)
            faulty = faulty_run(address, work / "faulty", args.timeout)
            same_tokens, replay_equal, replay_steps = same_tokens_reference(work / "faulty")
            reference = reference_run(address, work / "reference", args.timeout, faulty["final_step"])
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    stalls = [f["stall_s"] for f in faulty["faults"]]
    result = {
        "engine": "torchft",
        "nodes": NODES,
        "kills": sum(f["signal"] == "SIGKILL" for f in faulty["faults"]),
        "sigstops": sum(f["signal"] == "SIGSTOP" for f in faulty["faults"]),
        "rejoins": len(faulty["faults"]),
        "survivor_restarts": faulty["survivor_restarts"],
        "survivor_steps_lost": faulty["survivor_steps_lost"],
        "max_stall_s": stalls,
        "max_stall_s_overall": max(stalls),
        "stall_target_s": args.timeout + 2,
        "rejoined_bit_identical": all(f["bit_identical"] for f in faulty["faults"]),
        "final_replicas_identical": faulty["final_identical"],
        "val_loss": faulty["final_val_loss"],
        "val_loss_same_tokens": same_tokens,
        "val_loss_gap_pct": round(100 * (faulty["final_val_loss"] - same_tokens) / same_tokens, 3),
        "val_loss_all_replicas_every_step": reference,
        "val_loss_gap_pct_vs_all_replicas": round(100 * (faulty["final_val_loss"] - reference) / reference, 3),
        "same_tokens_replay_bit_identical_steps": f"{replay_equal}/{replay_steps}",
        "pickle_free_transport": True,  # every worker ran with --forbid-pickle and every rejoin healed
        "timeout_s": args.timeout,
        "steps": faulty["final_step"],
        "faults": faulty["faults"],
        "wall_s": round(time.time() - started, 1),
        "git_revision": revision.stdout.strip(),
        "machine": f"localhost, {os.cpu_count()} CPU cores, gloo",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
