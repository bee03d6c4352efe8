"""One rank of a multi-rank replica group in FlexDeMo's fault-tolerant mode (for tests/dist/test_ft_replica_groups.py).

Started like one rank of ``torchrun --nnodes 1 --nproc-per-node N`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` of this node's own launch, ``REPLICA_GROUP_ID``): a gloo default group over the node's ranks, the
model FSDP2-sharded over them by :class:`~lightning_hetero.flexdemo.runtime.FlexDeMoRuntime`, DeMo replication through
torchft's Manager as this rank's group rank. Each committed step appends a JSON line to
``<out>/group_<id>_rank_<rank>.jsonl``: the committed step, participants, pid and the SHA-256 of this rank's local
parameter shards. It trains until the committed step reaches the number in ``<out>/stop``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from ft_support import digest
from torch import nn

from lightning_hetero.flexdemo.runtime import FlexDeMoRuntime
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.replication import ReplicationSettings


class Net(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 8)) for _ in range(2)
        )
        self.head = nn.Linear(8, 3)  # 3 rows over 2 ranks: uneven shards (2 and 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = inputs + block(inputs)
        return self.head(inputs)


def _batch(group: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at a committed step: a discarded step retries with the same one."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * group + rank)
    inputs = torch.randn(4, 8, generator=generator)
    return inputs, torch.randn(4, 3, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), int(os.environ["REPLICA_GROUP_ID"])
    torch.manual_seed(group)  # different initial weights per group: the first quorum syncs them
    settings = FlexDeMoSettings(
        replication=ReplicationSettings(kind="demo", kept_fraction=0.25, chunk=8),
        fault_tolerance=FaultToleranceSettings(
            lighthouse=args.lighthouse, min_replicas=1, timeout_s=5.0, quorum_timeout_s=120.0, connect_timeout_s=30.0
        ),
    )
    runtime = FlexDeMoRuntime(settings)
    module = Net()
    runtime.setup_module(module, torch.device("cpu"))
    optimizer = runtime.prepare_optimizer(torch.optim.AdamW(module.parameters(), lr=0.01))
    path = args.out / f"group_{group}_rank_{rank}.jsonl"
    stop = args.out / "stop"

    def train_step() -> None:
        optimizer.zero_grad()
        inputs, target = _batch(group, rank, runtime.quorum.committed_steps)
        nn.functional.mse_loss(module(inputs), target).backward()
        optimizer.step()

    while True:
        limit = int(stop.read_text()) if stop.exists() else None
        if limit is not None and runtime.quorum.committed_steps >= limit:
            break
        runtime.quorum.committed_step(train_step, retry=True)
        metrics = runtime.quorum.metrics()
        record = {
            "step": runtime.quorum.committed_steps,
            "participants": int(metrics["ft/participants"]),
            "retries": int(metrics["ft/retries"]),
            "pid": os.getpid(),
            "digest": digest(module),
        }
        with path.open("a") as file:
            file.write(json.dumps(record) + "\n")
    with path.open("a") as file:
        record = {"final": True, "step": runtime.quorum.committed_steps, "digest": digest(module)}
        file.write(json.dumps(record) + "\n")
    runtime.teardown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
