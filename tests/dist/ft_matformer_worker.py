"""One node (one rank, one replica group) of a fault-tolerant tiered MatFormer run in the Lightning Trainer
(tests/dist/test_ft_matformer.py).

Started like a one-rank torchrun job of its own (``RANK=0``, ``WORLD_SIZE=1``, its own ``MASTER_PORT``,
``REPLICA_GROUP_ID``): ``Trainer(strategy=MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1, 1],
slice_weights=False, fault_tolerance=...)))`` on the tests' tiny Llama (FFN 64: tier 1 trains 32 units), node ``i``
at ``tiers[i]``, reading its shard of one token dataset (``num_replica_groups=3``). After every (committed) optimizer
step it appends one JSON line to ``<out>/node_<id>.jsonl``: the committed step, ``global_step``, the participants and
their FFN widths, the retries, ``comm/inter/bytes_sent_step``, the pid and a SHA-256 of every parameter. Once
``<out>/stop`` holds a number it becomes ``max_steps``; the last line (``final``) holds the digest after ``fit``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository's tests package
from lightning_hetero.data.stateful import StatefulDataLoader  # noqa: E402
from lightning_hetero.ft.settings import FaultToleranceSettings  # noqa: E402
from lightning_hetero.matformer.ft_exchange import payload_bytes  # noqa: E402
from lightning_hetero.matformer.settings import MatFormerSettings  # noqa: E402
from lightning_hetero.strategies.matformer.trainer import MatFormerStrategy  # noqa: E402
from tests.dist.ft_support import StepJournal, digest  # noqa: E402
from tests.fixtures import TinyLlama  # noqa: E402
from tests.token_data import progressions  # noqa: E402

TIERS = [0, 1, 1]


class _Slow(TinyLlama):
    """The tests' tiny Llama (seed 0) with a short pause per step, so that a kill lands mid-run."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(0.05)
        return self.model(**batch).loss


def _matformer_fields(trainer: L.Trainer, module: Any) -> dict[str, Any]:
    runtime = trainer.strategy.runtime
    return {
        "widths": [list(widths) for widths in runtime.participant_widths],
        "payload_bytes": payload_bytes(runtime.ft_specs, len(runtime.blocks)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    node = int(os.environ["REPLICA_GROUP_ID"])
    settings = MatFormerSettings(
        tiers=TIERS,
        slice_weights=False,
        fault_tolerance=FaultToleranceSettings(
            lighthouse=args.lighthouse,
            min_replicas=2,
            timeout_s=10.0,
            quorum_timeout_s=120.0,
            connect_timeout_s=30.0,
            num_replica_groups=len(TIERS),
        ),
    )
    path = args.out / f"node_{node}.jsonl"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=1,
        strategy=MatFormerStrategy(settings=settings),
        max_epochs=1,
        max_steps=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[StepJournal(path, args.out / "stop", _matformer_fields)],
    )
    module = _Slow()
    trainer.fit(module, StatefulDataLoader(progressions(6000), batch_size=4))
    with path.open("a") as file:
        file.write(json.dumps({"final": True, "global_step": trainer.global_step, "digest": digest(module)}) + "\n")


if __name__ == "__main__":
    main()
