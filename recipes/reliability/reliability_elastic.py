"""A node leaves mid-run under torchrun ``--nnodes=1:2``; the remaining node continues from the last checkpoint.

Two torchrun agents ("nodes", one rank each) join one elastic job on this machine (c10d rendezvous on localhost,
``--nnodes=1:2 --max-restarts=3``). Both run this script in ``--worker`` mode: a tiny Llama trained by Fabric with
``FlexDeMoStrategy`` (one replica per node, DeMo replicator), a directory checkpoint every ``--every`` steps. When
the job has finished ``--kill-at`` steps the orchestrator kills node 1 (its agent and worker, SIGKILL of its process
tree: a preemption without notice). Node 0's worker fails in its next collective, its agent restarts it, the
rendezvous closes with the one node left, and the worker resumes from the newest complete checkpoint: a checkpoint
of 2 replicas loaded on 1 (:mod:`lightning_hetero.flexdemo.reshard`: every new replica starts from the replica mean
of the error feedback and moments).

Measured per preemption (from the rank-0 event log each worker appends to, and the kill time):

- ``steps_lost``: steps done before the kill that were redone (last step before the kill - checkpoint step);
- ``seconds_lost``: how far behind the job is: the time it completes the step reached before the kill again, minus
  the time it first completed it (failure detection, rendezvous, process start, checkpoint load, redone steps);
- ``parts``: that time split into failure detected + rendezvous closed (kill -> new worker process), worker start
  (imports, process group, model setup, checkpoint load), and redoing the lost steps on the one node left.

The rendezvous waits ``--last-call`` seconds for more nodes before it closes a round with fewer than the maximum;
that wait is part of every restart (20 s here, so that both agents surely join the first round on a busy machine).

    python recipes/reliability/reliability_elastic.py          # writes docs/results/reliability_elastic.json (~2-4 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "docs" / "results" / "reliability_elastic.json"
CONFIG = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}


# ------------------------------------------------------------------------------------------------ worker
def _latest_checkpoint(root: Path) -> Path | None:
    """The newest ``step_*`` directory whose metadata and every rank part (with checksum) are on disk."""
    import torch

    for directory in sorted(root.glob("step_*"), reverse=True):
        meta = directory / "meta.pt"
        if not meta.is_file():
            continue
        world = int(torch.load(meta, weights_only=True)["world_size"])
        if all((directory / f"rank_{r:05d}.pt.sha256").is_file() for r in range(world)):
            return directory
    return None


def build_strategy(pg_timeout: float) -> Any:
    """The workers' Fabric ``FlexDeMoStrategy``: DeMo at 1/4, no overlap, a ``pg_timeout`` s collective timeout."""
    from lightning_hetero.flexdemo.settings import FlexDeMoSettings
    from lightning_hetero.replication.settings import ReplicationSettings
    from lightning_hetero.strategies.flexdemo.fabric import FlexDeMoStrategy

    settings = FlexDeMoSettings(replication=ReplicationSettings(kind="demo", kept_fraction=1 / 4), overlap=False)
    return FlexDeMoStrategy(settings=settings, timeout=timedelta(seconds=pg_timeout))


def worker(args: argparse.Namespace) -> None:
    spawned = time.time()  # before torch is imported: the moment the agent (re)started this process
    import torch
    from lightning.fabric import Fabric
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    strategy = build_strategy(args.pg_timeout)
    fabric = Fabric(accelerator="cpu", devices=1, num_nodes=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(LlamaForCausalLM(LlamaConfig(**CONFIG)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    root = Path(args.out) / "checkpoints"
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    latest = _latest_checkpoint(root)
    started = time.time()
    if latest is not None:
        fabric.load(latest, state)
    events = Path(args.out) / "events.jsonl"

    def log(record: dict[str, Any]) -> None:
        if fabric.global_rank == 0:
            with open(events, "a") as stream:
                line = {"time": time.time(), **record, "world_size": world, "restart": restart}
                stream.write(json.dumps(line) + "\n")

    log({"event": "spawned", "time": spawned})
    log({"event": "start", "resumed_from": state["step"], "load_seconds": time.time() - started})
    generator = torch.Generator().manual_seed(1)
    data = (torch.arange(12)[None] * torch.randint(1, 5, (256, 1), generator=generator)) % CONFIG["vocab_size"]
    for step in range(state["step"], args.steps):
        rows = data[(step * world + fabric.global_rank) * 2 % 256 :][:2]
        loss = model(input_ids=rows, labels=rows).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        log({"event": "step", "step": step + 1, "loss": loss.item()})
        if (step + 1) % args.every == 0:
            fabric.save(root / f"step_{step + 1:05d}", state)
            log({"event": "checkpoint", "step": step + 1})
        time.sleep(args.step_pause)  # a stand-in for a longer step, so the kill lands between checkpoints
    log({"event": "done", "step": state["step"]})


# ------------------------------------------------------------------------------------------------ orchestrator
def _agent(node: int, args: argparse.Namespace, port: int, out: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=reliability-elastic",
        f"--rdzv-conf=join_timeout=300,last_call_timeout={args.last_call},close_timeout=10",
        "--max-restarts=3",
        "--monitor-interval=0.5",
        str(Path(__file__).resolve()),
        "--worker",
        f"--out={out}",
        f"--steps={args.steps}",
        f"--every={args.every}",
        f"--step-pause={args.step_pause}",
        f"--pg-timeout={args.pg_timeout}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "LOGLEVEL": "INFO"}
    log = open(out / f"node{node}.log", "w")  # noqa: SIM115 - closed with the process at exit
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc: torchrun's workers are not in their agent's process group)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants at once (a node that disappears without notice)."""
    for target in [*_descendants(pid), pid]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_port(port: int, seconds: float) -> None:
    import socket

    deadline = time.time() + seconds
    while time.time() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"node 0's rendezvous store did not open port {port} within {seconds} s.")


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure(events: list[dict[str, Any]], killed_at: float) -> dict[str, Any]:
    """Steps and seconds lost by the preemption, from the rank-0 event log and the kill time."""
    before = [e for e in events if e["event"] == "step" and e["time"] <= killed_at]
    after = [e for e in events if e["event"] == "step" and e["time"] > killed_at]
    spawned = next(e for e in events if e["event"] == "spawned" and e["time"] > killed_at)
    restart = next(e for e in events if e["event"] == "start" and e["time"] > killed_at)
    reached = max(e["step"] for e in before)
    back = next(e for e in after if e["step"] >= reached)
    return {
        "world_size_before": before[-1]["world_size"],
        "world_size_after": after[0]["world_size"],
        "step_reached_before_kill": reached,
        "resumed_from_checkpoint_step": restart["resumed_from"],
        "steps_lost": reached - restart["resumed_from"],
        # The job is this far behind: when it completes step `reached` again, minus when it first completed it.
        "seconds_lost": back["time"] - before[-1]["time"],
        "seconds_kill_to_first_step": after[0]["time"] - killed_at,
        "parts": {
            "failure_detected_and_rendezvous": spawned["time"] - killed_at,
            "worker_start_and_checkpoint_load": restart["time"] - spawned["time"],
            "checkpoint_load": restart["load_seconds"],
            "redo_lost_steps": back["time"] - restart["time"],
        },
        "mean_step_seconds_before": (before[-1]["time"] - before[0]["time"]) / max(1, len(before) - 1),
        "mean_step_seconds_after": (after[-1]["time"] - after[0]["time"]) / max(1, len(after) - 1),
        "loss_before_kill": before[-1]["loss"],
        "loss_first_after": after[0]["loss"],
        "final_step": max(e["step"] for e in events if e["event"] == "step"),
    }


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import socket

    load_at_start = os.getloadavg()[0]  # the machine is shared: a loaded one makes every start slower
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    survivor = _agent(0, args, port, out)
    _wait_for_port(port, 120.0)  # node 0 hosts the rendezvous store (it must be the one that stays)
    leaver = _agent(1, args, port, out)
    events_file = out / "events.jsonl"
    deadline = time.time() + args.deadline
    killed_at = None
    try:
        while time.time() < deadline:
            steps = [e["step"] for e in _events(events_file) if e["event"] == "step"]
            if steps and max(steps) >= args.kill_at:
                _kill_tree(leaver.pid)  # the node leaves: agent and worker, no notice
                killed_at = time.time()
                break
            time.sleep(0.05)
        if killed_at is None:
            raise RuntimeError(f"the job did not reach step {args.kill_at} in {args.deadline} s; see {out}/node*.log")
        survivor.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for process in (survivor, leaver):
            _kill_tree(process.pid)
    events = _events(events_file)
    if not any(e["event"] == "done" for e in events):
        raise RuntimeError(f"the remaining node did not finish (exit {survivor.returncode}); see {out}/node0.log")
    return {
        "command": "python recipes/reliability/reliability_elastic.py",
        "launcher": "torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d --max-restarts=3 (2 agents)",
        "strategy": (
            "FlexDeMoStrategy(settings=FlexDeMoSettings(replication=ReplicationSettings(kind='demo',"
            " kept_fraction=1/4), overlap=False)), Fabric, tiny Llama (2 layers, hidden 32)"
        ),
        "settings": {
            k: getattr(args, k) for k in ("steps", "every", "kill_at", "step_pause", "pg_timeout", "last_call")
        },
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1min_at_start": load_at_start,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "preemptions": [measure(events, killed_at)],
        "events": events,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help="run as a torchrun worker (internal)")
    parser.add_argument("--out", default="/tmp/reliability_elastic", help="scratch folder (checkpoints, logs)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of the job")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, default=13, help="kill node 1 once this many steps are done")
    parser.add_argument("--step-pause", type=float, default=0.2, help="seconds of extra work per step")
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout, seconds")
    parser.add_argument(
        "--last-call", type=int, default=20, help="rendezvous last-call seconds (waiting for more nodes)"
    )
    parser.add_argument("--deadline", type=float, default=540.0, help="give up after this many seconds")
    parser.add_argument("--result", default=str(RESULT), help="where the JSON goes")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    result = orchestrate(args)
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["preemptions"], indent=2))


if __name__ == "__main__":
    main()
