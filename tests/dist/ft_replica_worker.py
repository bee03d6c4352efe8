"""One replica group (one process) on :class:`~lightning_hetero.ft.replicas.FaultTolerantReplica`, for
tests/dist/test_ft_spot.py, test_ft_security.py and test_ft_lighthouse.py.

Trains a small regression MLP on a torchft lighthouse (gradients averaged through the replica, gloo on CPU) and appends
one JSON line per committed step to ``<out>/replica_<id>.jsonl``: the step, the participants, the pid, the time, the
loss and the SHA-256 of the weights after the step. It stops once ``<out>/stop`` holds a step number and that step is
committed; the last line (``final``) holds the step and the weights' hash. A refused recovery checkpoint ends the
process with exit code 3 and the message in ``<out>/replica_<id>.error``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.ft.replicas import FaultTolerantReplica
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.testing.no_pickle import forbid_pickle

FEATURES, HIDDEN = 8, 16
STEP_SLEEP = 0.05
"""Seconds of 'compute' per step: a kill or a rogue lands mid-run."""


def build(hidden: int = HIDDEN) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer every replica starts from (a restarted one too: healing brings it up to date)."""
    torch.manual_seed(1000)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.02)


def _batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``replica`` at ``step``: a retried step sees the same data."""
    generator = torch.Generator().manual_seed(7_000_003 * step + 101 * replica)
    inputs = torch.randn(32, FEATURES, generator=generator)
    return inputs, torch.sin(inputs.sum(dim=1, keepdim=True))


def _digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for param in model.parameters():
        sha.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _stop_step(stop: Path) -> int | None:
    """The step number in ``stop`` once the test wrote it (an empty file: being written)."""
    text = stop.read_text().strip() if stop.exists() else ""
    return int(text) if text else None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--replica-id", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="another width is another layout (an impostor)")
    parser.add_argument("--quorum-timeout", type=float, default=120.0)
    parser.add_argument("--quorum-retries", type=int, default=None, help="default: FaultToleranceSettings'")
    parser.add_argument("--forbid-pickle", action="store_true")
    args = parser.parse_args()
    if args.forbid_pickle:
        forbid_pickle()
    model, optimizer = build(args.hidden)
    settings = FaultToleranceSettings(
        lighthouse=args.lighthouse,
        min_replicas=2,
        timeout_s=5.0,
        quorum_timeout_s=args.quorum_timeout,
        connect_timeout_s=30.0,
        replica_id_source="fixed",
        replica_id=f"spot{args.replica_id}",
        **({} if args.quorum_retries is None else {"quorum_retries": args.quorum_retries}),
    )
    replica = FaultTolerantReplica(settings, model=model, optimizer=optimizer, store_host="localhost")
    path, stop = args.out / f"replica_{args.replica_id}.jsonl", args.out / "stop"
    try:
        while (limit := _stop_step(stop)) is None or replica.current_step() < limit:
            try:
                replica.start_step()
            except PeerPayloadError as error:
                (args.out / f"replica_{args.replica_id}.error").write_text(f"{type(error).__name__}: {error}\n")
                return 3
            inputs, target = _batch(replica.current_step(), args.replica_id)
            loss = torch.nn.functional.mse_loss(model(inputs), target)
            loss.backward()
            time.sleep(STEP_SLEEP)
            replica.average_gradients(model.parameters())
            if replica.should_commit():
                optimizer.step()
                record = {
                    "step": replica.current_step(),
                    "participants": replica.num_participants(),
                    "pid": os.getpid(),
                    "time": time.time(),
                    "loss": float(loss.detach()),
                    "digest": _digest(model),
                }
                with path.open("a") as file:
                    file.write(json.dumps(record) + "\n")
            optimizer.zero_grad()
        with path.open("a") as file:
            file.write(json.dumps({"final": True, "step": replica.current_step(), "digest": _digest(model)}) + "\n")
        return 0
    finally:
        replica.shutdown()


if __name__ == "__main__":
    sys.exit(main())
