"""Why bare FlexDeMo on one model copy uses no compression: loss at step 10 with demo, full and no FlexDeMo.

One process, the 2-layer user Llama of ``tests/usercode/usernets.py``, 10 AdamW steps each (seconds on a CPU)::

    PYTHONPATH=. python recipes/flexdemo/flexdemo_one_copy.py     # from the repository root

Prints one JSON object: the training loss at the last step per variant (docs/flexdemo.md, "One copy").
"""

from __future__ import annotations

import json

import lightning as L

from lightning_hetero import FlexDeMoSettings, FlexDeMoStrategy, ReplicationSettings
from tests.usercode.usernets import UserLlama

STEPS = 10


class LastLoss(L.Callback):
    """Keeps the training loss of the last step."""

    loss = float("nan")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loss = float(outputs["loss"])


def last_loss(strategy_factory) -> float:
    """Train a freshly seeded user Llama for ``STEPS`` steps under the strategy and return its last loss."""
    L.seed_everything(0, verbose=False)
    recorder = LastLoss()
    trainer = L.Trainer(
        strategy=strategy_factory(),
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(UserLlama())
    return round(recorder.loss, 4)


def main() -> None:
    variants = {
        "flexdemo_demo": lambda: FlexDeMoStrategy(
            settings=FlexDeMoSettings(replication=ReplicationSettings(kind="demo"))
        ),
        "flexdemo_full": lambda: FlexDeMoStrategy(
            settings=FlexDeMoSettings(replication=ReplicationSettings(kind="full"))
        ),
        "no_flexdemo": lambda: "auto",
    }
    print(json.dumps({"steps": STEPS, "loss_at_last_step": {name: last_loss(f) for name, f in variants.items()}}))


if __name__ == "__main__":
    main()
