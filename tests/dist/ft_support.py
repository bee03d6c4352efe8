"""What the fault-tolerant dist tests and their workers share: starting a replica group's ranks, waiting on live
processes, the Trainer workers' journal of committed steps and reading it, and weight digests.

The workers (tests/dist/ft_*_worker.py) run as scripts and import this module as ``ft_support``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_hetero.flexdemo.sharding import local_tensor
from lightning_hetero.testing import find_free_port

REPO = Path(__file__).resolve().parents[2]


def start_node(
    worker: Path, address: str, group: int, out: Path, ranks: int, *extra: str
) -> dict[str, subprocess.Popen]:
    """The ``ranks`` processes of replica group ``group``, each as its node's own ``torchrun --nnodes 1
    --nproc-per-node ranks`` would start it (its own ``MASTER_PORT``, ``REPLICA_GROUP_ID``), named ``group G rank R``.
    """
    port = str(find_free_port())
    procs = {}
    for rank in range(ranks):
        env = {
            **os.environ,
            "RUST_LOG": "warn",
            "PYTHONUNBUFFERED": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": f"node{group}",
            "REPLICA_GROUP_ID": str(group),
        }
        log = (out / f"worker_{group}_{rank}_{time.monotonic_ns()}.log").open("w")
        command = [sys.executable, str(worker), "--lighthouse", address, "--out", str(out), *extra]
        procs[f"group {group} rank {rank}"] = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )
    return procs


def wait_for(
    condition: Callable[[], bool], what: str, procs: Mapping[object, subprocess.Popen], timeout: float = 300.0
) -> None:
    """Poll ``condition`` until true; fail at once naming a process of ``procs`` that exited with an error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for name, proc in procs.items():
            if proc.poll() not in (None, 0):
                raise AssertionError(f"process {name} exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def read_records(path: Path, *, final: bool = False) -> list[dict]:
    """The complete JSON lines a worker appended to ``path`` so far: its step records, or with ``final`` its last."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return [r for r in records if bool(r.get("final")) == final]


def digest(module: torch.nn.Module) -> str:
    """SHA-256 of this rank's parameters (names and local shards' bytes): equal digests, bit-identical replicas."""
    sha = hashlib.sha256()
    for name, param in sorted(module.named_parameters()):
        sha.update(name.encode())
        sha.update(local_tensor(param.detach()).contiguous().numpy().tobytes())
    return sha.hexdigest()


class StepJournal(L.Callback):
    """One JSON line per committed step of a fault-tolerant Trainer node, appended to ``path``: the committed step,
    ``global_step``, participants, retries, batches dropped so far, the pid, the bytes handed to the Manager and the
    weights' digest, plus ``extra(trainer, module)``. A dropped batch (its step committed without this node) writes
    nothing. Once ``stop`` holds a number it becomes ``max_steps``, so every node stops at the same committed step."""

    def __init__(self, path: Path, stop: Path, extra: Callable[[Any, Any], dict[str, Any]]) -> None:
        self.path, self.stop, self.extra = path, stop, extra

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        quorum = trainer.strategy.runtime.quorum
        if quorum.last_abandoned:
            return
        sent = trainer.callback_metrics.get("comm/inter/bytes_sent_step")
        record = {
            "step": quorum.replica.current_step(),
            "global_step": trainer.global_step,
            "participants": quorum.replica.num_participants(),
            "retries": quorum.last_retries,
            "abandoned": quorum.abandoned_batches,
            "pid": os.getpid(),
            "inter_bytes_sent": None if sent is None else int(sent),
            "digest": digest(module),
            **self.extra(trainer, module),
        }
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        text = self.stop.read_text().strip() if self.stop.exists() else ""
        if text:
            trainer.fit_loop.epoch_loop.max_steps = int(text)


@contextmanager
def lighthouse_and_nodes(
    min_replicas: int = 2, join_timeout_ms: int = 500
) -> Iterator[tuple[str, dict[Any, subprocess.Popen]]]:
    """A torchft lighthouse (``heartbeat_timeout_ms`` 1500, as docs/spot.md) and a dict for the node processes a test
    starts: yields ``(address, procs)``; at exit every process still running is resumed (if stopped) and killed, and
    the lighthouse shut down."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=1500
    )
    procs: dict[Any, subprocess.Popen] = {}
    try:
        yield lighthouse.address(), procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        lighthouse.shutdown()
