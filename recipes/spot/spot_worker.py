"""One replica group (one process) of the spot-worker runs: tests/dist/test_ft_spot.py and spot_lighthouse_restart.py.

Trains a small regression MLP through :class:`~lightning_hetero.ft.replicas.FaultTolerantReplica` on a torchft
lighthouse and appends one JSON line per committed step to ``<out>/replica_<id>.jsonl``: the step, the participants,
this process's pid, the time, the training loss and a SHA-256 of the weights after the step (bit-identity checks).
It stops once ``<out>/stop`` holds a step number and that step is committed. A refused recovery checkpoint ends the
process with exit code 3 and the message in ``<out>/replica_<id>.error``.

    python recipes/spot/spot_worker.py --lighthouse http://localhost:29510 --replica-id 0 --out /tmp/spot
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

FEATURES = 8
BATCH = 32


def batch(step: int, replica: int, *, validation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``replica`` at ``step`` (a function of both only: a retried step sees the same data)."""
    generator = torch.Generator().manual_seed(7_000_003 * step + 101 * replica + (1 << 40 if validation else 0))
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    target = torch.sin(inputs.sum(dim=1, keepdim=True)) + 0.1 * inputs[:, :1]
    return inputs, target


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order."""
    sha = hashlib.sha256()
    for param in model.parameters():
        sha.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def validation_loss(model: torch.nn.Module, batches: int = 8) -> float:
    """Mean squared error on fixed held-out batches."""
    with torch.no_grad():
        losses = [
            torch.nn.functional.mse_loss(model(x), y) for x, y in (batch(i, 0, validation=True) for i in range(batches))
        ]
    return float(torch.stack(losses).mean())


def build(hidden: int = 16, lr: float = 0.02, seed: int = 1000) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer every replica starts from (a restarted one too: healing brings it up to date)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--replica-id", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=16, help="hidden width (another width = another layout)")
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds of 'compute' per step")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--quorum-timeout", type=float, default=120.0, help="FaultToleranceSettings.quorum_timeout_s")
    parser.add_argument("--quorum-retries", type=int, default=None, help="FaultToleranceSettings.quorum_retries")
    parser.add_argument(
        "--forbid-pickle", action="store_true", help="make every unpickling call raise (proves a heal never unpickles)"
    )
    args = parser.parse_args(argv)
    if args.forbid_pickle:
        forbid_pickle()

    model, optimizer = build(args.hidden, args.lr)
    settings = FaultToleranceSettings(
        lighthouse=args.lighthouse,
        min_replicas=args.min_replicas,
        timeout_s=args.timeout,
        quorum_timeout_s=args.quorum_timeout,
        connect_timeout_s=30.0,
        replica_id_source="fixed",
        replica_id=f"spot{args.replica_id}",
        **({} if args.quorum_retries is None else {"quorum_retries": args.quorum_retries}),
    )
    replica = FaultTolerantReplica(settings, model=model, optimizer=optimizer, store_host="localhost")
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / f"replica_{args.replica_id}.jsonl").open("a", buffering=1)
    stop_file = args.out / "stop"
    try:
        while True:
            if stop_file.exists():
                text = stop_file.read_text().strip()
                if text and replica.current_step() >= int(text):
                    break
            try:
                replica.start_step()
            except PeerPayloadError as error:
                (args.out / f"replica_{args.replica_id}.error").write_text(f"{type(error).__name__}: {error}\n")
                return 3
            inputs, target = batch(replica.current_step(), args.replica_id)
            loss = torch.nn.functional.mse_loss(model(inputs), target)
            loss.backward()
            time.sleep(args.step_sleep)
            replica.average_gradients(model.parameters())
            if replica.should_commit():
                optimizer.step()
                record = {
                    "step": replica.current_step(),
                    "participants": replica.num_participants(),
                    "pid": os.getpid(),
                    "time": time.time(),
                    "loss": float(loss.detach()),
                    "digest": digest(model),
                }
                log.write(json.dumps(record) + "\n")
            optimizer.zero_grad()
        final = {
            "final": True,
            "step": replica.current_step(),
            "val_loss": validation_loss(model),
            "digest": digest(model),
        }
        log.write(json.dumps(final) + "\n")
        return 0
    finally:
        log.close()
        replica.shutdown()


if __name__ == "__main__":
    sys.exit(main())
