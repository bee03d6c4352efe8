"""The Trainer-position module against a live Lightning ``fit``: every private attribute it touches still exists (a
Lightning upgrade that moves one fails here, not in a spot run), the position it reports is the loop's, and a peer's
position is validated before anything is adopted."""

from __future__ import annotations

import importlib
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.strategies.trainer_position import (
    LIGHTNING_PRIVATE_ATTRIBUTES,
    POSITION_KEYS,
    TrainerPosition,
    batches_in_flight,
    checked_position,
)
from tests.fixtures import quiet_trainer


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        features, target = batch
        return nn.functional.mse_loss(self.layer(features), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Probe(L.Callback):
    """Resolves every listed path and records the position at each batch start."""

    def __init__(self) -> None:
        self.missing: set[str] = set()
        self.positions: list[dict[str, int]] = []
        self.in_flight: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        for path in LIGHTNING_PRIVATE_ATTRIBUTES:
            value: Any = trainer
            for name in path.split("."):
                if not hasattr(value, name):
                    self.missing.add(path)
                    break
                value = getattr(value, name)
        self.positions.append(TrainerPosition(trainer).state_dict())
        self.in_flight.append(batches_in_flight(trainer))


def _fit(max_steps: int) -> _Probe:
    data = TensorDataset(torch.randn(12, 4), torch.randn(12, 1))
    probe = _Probe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    trainer.fit(_Regression(), DataLoader(data, batch_size=4))
    return probe


def test_every_private_lightning_attribute_used_exists_during_fit() -> None:
    probe = _fit(max_steps=5)
    assert not probe.missing, (
        f"Lightning moved {sorted(probe.missing)}: update lightning_hetero.strategies.trainer_position"
    )


def test_private_lightning_helpers_imported_by_the_spot_code_exist() -> None:
    # shard_train_loader rebuilds the train loader with Lightning's private helper.
    assert callable(importlib.import_module("lightning.pytorch.utilities.data")._update_dataloader)


def test_the_position_follows_the_loop_across_an_epoch_boundary() -> None:
    probe = _fit(max_steps=5)  # 3 batches per epoch
    assert [p["global_step"] for p in probe.positions] == [0, 1, 2, 3, 4]
    assert [(p["epoch"], p["batches"]) for p in probe.positions] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert [p["batches_that_stepped"] for p in probe.positions] == [0, 1, 2, 3, 4]
    assert probe.in_flight == [1] * 5  # at batch start the drawn batch has no committed step yet
    assert all(set(p) == set(POSITION_KEYS) for p in probe.positions)


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ([1, 2, 3, 4], "extra.trainer_position"),
        ({"global_step": 3, "batches_that_stepped": 3, "epoch": 0}, "extra.trainer_position.batches"),
        (
            {"global_step": -1, "batches_that_stepped": 0, "epoch": 0, "batches": 0},
            "extra.trainer_position.global_step",
        ),
        ({"global_step": 1, "batches_that_stepped": True, "epoch": 0, "batches": 0}, "extra.trainer_position."),
        ({"global_step": 1, "batches_that_stepped": 1, "epoch": 0.5, "batches": 0}, "extra.trainer_position.epoch"),
    ],
)
def test_a_peer_position_that_is_not_counts_is_refused(state: Any, field: str) -> None:
    with pytest.raises(PeerPayloadError) as refused:
        checked_position(state)
    assert field in str(refused.value.field)


def test_a_valid_peer_position_is_taken_as_is() -> None:
    state = {"global_step": 7, "batches_that_stepped": 9, "epoch": 1, "batches": 2, "unknown": "ignored"}
    assert checked_position(state) == {"global_step": 7, "batches_that_stepped": 9, "epoch": 1, "batches": 2}


class _IndexedRegression(_Regression):
    """Records the sample index of each batch it steps on; on ``drop_at`` it runs the closure but steps nothing."""

    def __init__(self, drop_at: int) -> None:
        super().__init__()
        self.drop_at = drop_at
        self.position: TrainerPosition | None = None
        self.stepped: list[int] = []
        self.lrs: list[float] = []
        self.current = -1

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.current = int(batch[0])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, features, target = batch
        return nn.functional.mse_loss(self.layer(features), target)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if self.current == self.drop_at:  # what the FlexDeMo adapter does when the quorum overtook the batch
            optimizer_closure()
            assert self.position is not None
            self.position.drop_batch_in_flight()
            return
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self.stepped.append(self.current)
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)


class _HealInPlace(L.Callback):
    """At the batch start of sample ``at``, adopt a peer's position ``peer_step`` steps in (as an in-place heal does:
    the peer's LR schedule and learning rate come with it)."""

    def __init__(self, at: int, peer_step: int) -> None:
        self.at, self.peer_step = at, peer_step
        self.position: TrainerPosition | None = None
        self.seen: list[dict[str, int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if self.position is None:
            self.position = module.position = TrainerPosition(trainer)
            self.position.start()
        self.position.first_batch()
        self.seen.append(self.position.state_dict())
        if int(batch[0]) == self.at:
            scheduler = trainer.lr_scheduler_configs[0].scheduler
            for _ in range(self.peer_step - scheduler.last_epoch):
                scheduler.step()  # the peer's schedule state, as the recovery loads it
            step = self.peer_step
            self.position.load_state_dict(
                {"global_step": step, "batches_that_stepped": step, "epoch": 0, "batches": step}
            )


def test_a_node_healed_in_place_drops_the_batch_of_the_step_it_missed_and_reads_the_committed_steps_next() -> None:
    from lightning_hetero.data.stateful import StatefulDataLoader

    samples = 12
    data = TensorDataset(torch.arange(samples), torch.randn(samples, 4), torch.randn(samples, 1))
    module = _IndexedRegression(drop_at=2)
    heal = _HealInPlace(at=2, peer_step=5)  # the node drew sample 2 (its step 3); the peers have committed 5 steps
    trainer = quiet_trainer(devices=1, max_steps=8, callbacks=[heal])
    trainer.fit(module, StatefulDataLoader(data, batch_size=None))
    # Sample 2 is not trained; the next batch is the committed step's (sample 5 = position step - 1): nothing skipped.
    assert module.stepped == [0, 1, 5, 6, 7]
    assert trainer.global_step == 8
    after = heal.seen[3]  # the batch start after the dropped one: exactly the peer's position
    assert (after["global_step"], after["batches"], after["batches_that_stepped"]) == (5, 5, 5)
    # The learning rate follows the committed steps (StepLR halves per step), not the batches Lightning finished.
    assert module.lrs == pytest.approx([0.1 * 0.5**step for step in (0, 1, 5, 6, 7)])
