"""StatefulDataLoader: a restored loader continues with exactly the next batch (alone, in Lightning, in Fabric)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.data import _update_dataloader
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_hetero.data.base import make_dataloader
from lightning_hetero.data.stateful import EpochSeededRandomSampler, StatefulDataLoader

DATA = list(range(40))


def _loader(**kwargs: Any) -> StatefulDataLoader:
    return StatefulDataLoader(DATA, batch_size=2, shuffle=True, seed=3, drop_last=True, **kwargs)


def _epochs(loader: DataLoader, epochs: int) -> list[list[int]]:
    batches = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        batches += [batch.tolist() for batch in loader]
    return batches


def _take(loader: DataLoader, count: int) -> list[list[int]]:
    iterator = iter(loader)
    return [next(iterator).tolist() for _ in range(count)]


def test_each_epoch_is_a_permutation_seeded_by_seed_plus_epoch():
    straight = _epochs(_loader(), 2)
    for epoch in range(2):
        order = torch.randperm(40, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
        assert [i for batch in straight[20 * epoch : 20 * (epoch + 1)] for i in batch] == order
    assert straight[:20] != straight[20:]
    assert sorted(i for batch in straight[20:] for i in batch) == DATA


@pytest.mark.parametrize(
    "workers", [{}, {"num_workers": 1, "persistent_workers": True}, {"num_workers": 2}], ids=["main", "persistent", "2"]
)
@pytest.mark.parametrize("epoch, stop", [(0, 7), (1, 5), (0, 0), (1, 19)])
def test_restored_loader_continues_with_the_next_batch(workers, epoch, stop):
    straight = _epochs(_loader(), 2)
    first = _loader(**workers)
    first.sampler.set_epoch(epoch)
    seen = _take(first, stop)
    state = first.state_dict()
    assert state["epoch"] == epoch and state["batches_yielded"] == stop
    resumed = _loader(**workers)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["batches_yielded"] == stop  # restored, not yet iterated
    rest = [batch.tolist() for batch in resumed]
    assert seen + rest == straight[20 * epoch : 20 * (epoch + 1)]
    assert resumed.state_dict() == {**state, "epoch": epoch + 1, "batches_yielded": 0}  # a finished epoch


def test_a_finished_epoch_is_saved_as_the_start_of_the_next():
    loader = _loader()
    first_epoch = [batch.tolist() for batch in loader]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batches_yielded"] == 0
    # Lightning saves at the last batch's end, before the loader has seen its end: nothing to skip either.
    again = _loader()
    _take(again, 20)
    assert again.state_dict()["epoch"] == 1
    resumed = _loader()
    resumed.load_state_dict(again.state_dict())
    assert [batch.tolist() for batch in resumed] == _epochs(_loader(), 2)[20:] != first_epoch


def test_epochs_never_go_back_after_a_restore():
    """Fabric's loader wrapper numbers epochs from 0 in each process: the restored epoch wins, and the next follows."""
    straight = _epochs(_loader(), 4)
    resumed = _loader()
    resumed.load_state_dict({"epoch": 2, "batches_yielded": 3})
    resumed.sampler.set_epoch(0)  # what Fabric's wrapper does before its first iteration
    assert [batch.tolist() for batch in resumed] == straight[43:60]
    resumed.sampler.set_epoch(1)  # and before its second
    assert [batch.tolist() for batch in resumed] == straight[60:80]


def test_distributed_sampler_position_and_a_different_world_size():
    """The position converts through samples consumed by all replicas: 6 batches x 2 ranks = 12 batches x 1 rank."""

    def loader(rank: int, replicas: int) -> StatefulDataLoader:
        sampler = DistributedSampler(DATA, num_replicas=replicas, rank=rank, shuffle=True, seed=5)
        return StatefulDataLoader(DATA, batch_size=2, sampler=sampler, drop_last=True)

    two = [loader(rank, 2) for rank in range(2)]
    for ranked in two:
        ranked.sampler.set_epoch(1)
    consumed = [_take(ranked, 6) for ranked in two]
    state = two[0].state_dict()
    assert state["num_replicas"] == 2 and state["batches_yielded"] == 6
    for rank in range(2):
        again = loader(rank, 2)
        again.load_state_dict(state)
        assert again.sampler.epoch == 1
        assert consumed[rank] + [b.tolist() for b in again] == _epochs_of(loader(rank, 2), 1)
    single = loader(0, 1)
    single.load_state_dict(state)
    rest = {i for batch in single for i in batch.tolist()}
    assert rest == set(DATA) - {i for batches in consumed for batch in batches for i in batch}
    odd = loader(0, 1)
    with pytest.warns(UserWarning, match="the last 1 are seen again"):
        odd.load_state_dict({**state, "batches_yielded": 5, "batch_size": 3, "num_replicas": 1})
    assert odd.state_dict()["batches_yielded"] == 7  # 15 samples: 7 whole batches of 2


class _EpochBatches:
    """A user's batch sampler with its own ``set_epoch``: pairs in an order that depends on the epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 20

    def __iter__(self):
        order = torch.randperm(40, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        return iter([order[i : i + 2] for i in range(0, 40, 2)])


def test_a_batch_sampler_with_set_epoch_is_restored_too():
    straight = StatefulDataLoader(DATA, batch_sampler=_EpochBatches())
    straight.batch_sampler.set_epoch(2)
    expected = [batch.tolist() for batch in straight]
    resumed = StatefulDataLoader(DATA, batch_sampler=_EpochBatches())
    resumed.load_state_dict({"epoch": 2, "batches_yielded": 6})
    assert resumed.batch_sampler.epoch == 2
    assert [batch.tolist() for batch in resumed] == expected[6:]


def _epochs_of(loader: StatefulDataLoader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [batch.tolist() for batch in loader]


def test_lightning_recreates_it_with_a_distributed_sampler():
    """What the Trainer does in distributed runs: same class, same state interface, the position still applies."""
    loader = make_dataloader(DATA, batch_size=2, train=True, num_workers=0, seed=3)
    assert isinstance(loader, StatefulDataLoader) and isinstance(loader, _Stateful)
    assert isinstance(loader.sampler, RandomSampler)  # Lightning then injects a plain DistributedSampler
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=0)
    recreated = _update_dataloader(loader, sampler)
    assert type(recreated) is StatefulDataLoader and recreated.sampler is sampler and recreated.seed == 3
    recreated.load_state_dict({"epoch": 0, "batches_yielded": 4, "batch_size": 2, "num_replicas": 2})
    assert len([batch for batch in recreated]) == len(recreated) - 4
    assert not isinstance(make_dataloader(DATA, batch_size=2, train=False, num_workers=0, seed=3), StatefulDataLoader)


def test_bad_input_is_refused_with_the_fix():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(DATA)

    with pytest.raises(TypeError, match="map-style"):
        StatefulDataLoader(Stream(), batch_size=2)
    with pytest.raises(ValueError, match="batches_yielded"):
        _loader().load_state_dict({"epoch": 0})
    sampler = EpochSeededRandomSampler(DATA, seed=1)
    sampler.set_epoch(4)
    assert list(sampler) == torch.randperm(40, generator=torch.Generator().manual_seed(5)).tolist()


class _Batches(L.LightningModule):
    """Records the batches it trains on; its one weight moves with each batch, so the order shows in the result."""

    def __init__(self, plain: bool = False) -> None:
        super().__init__()
        self.plain = plain
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.tolist())
        return ((self.weight - batch.float().mean()) ** 2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        if self.plain:  # what the DataModules handed out before: Lightning restarts an interrupted epoch
            return DataLoader(DATA, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3))
        return _loader()


class _SaveAt(Callback):
    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit(
    max_steps: int, callbacks: list[Callback] = (), ckpt_path: Path | None = None, plain: bool = False
) -> _Batches:
    module = _Batches(plain)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not resumable.*")  # the plain loader's case
        trainer.fit(module, ckpt_path=ckpt_path)
    return module


@pytest.mark.parametrize("stop", [7, 20, 27])
def test_trainer_resumes_mid_epoch_with_the_next_batch(tmp_path, stop):
    """Stop at ``stop`` (mid-epoch 0, its last batch, mid-epoch 1), resume to step 45: same batches, same weight."""
    straight = _fit(45)
    first = _fit(stop, [_SaveAt(tmp_path / "stop.ckpt", stop)])
    saved = torch.load(tmp_path / "stop.ckpt", weights_only=True)["loops"]["fit_loop"]["state_dict"]
    assert saved["combined_loader"][0]["batches_yielded"] == stop % 20
    resumed = _fit(45, ckpt_path=tmp_path / "stop.ckpt")
    assert first.seen + resumed.seen == straight.seen
    assert torch.equal(resumed.weight, straight.weight)


def test_fabric_saves_and_restores_the_loader_in_its_state(tmp_path):
    """``fabric.save``/``fabric.load`` with the wrapped loader in the state: the restored loop continues in epoch 1."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    straight = _epochs(_loader(), 3)
    loader = fabric.setup_dataloaders(_loader())
    seen = [batch.tolist() for batch in loader]  # epoch 0
    iterator = iter(loader)  # epoch 1: Fabric's wrapper sets the sampler's epoch from its own count
    seen += [next(iterator).tolist() for _ in range(4)]
    fabric.save(tmp_path / "fabric.ckpt", {"train_loader": loader, "step": 24})
    restored = fabric.setup_dataloaders(_loader())  # a new process: the wrapper counts epochs from 0 again
    remainder = fabric.load(tmp_path / "fabric.ckpt", {"train_loader": restored})
    assert remainder == {"step": 24}
    rest = [batch.tolist() for batch in restored] + [batch.tolist() for batch in restored]
    assert seen + rest == straight


def test_a_plain_loader_repeats_the_interrupted_epoch(tmp_path):
    """The control: with a plain DataLoader the resumed run restarts epoch 0 and trains on other batches."""
    straight = _fit(20, plain=True)
    first = _fit(7, [_SaveAt(tmp_path / "stop.ckpt", 7)], plain=True)
    resumed = _fit(20, ckpt_path=tmp_path / "stop.ckpt", plain=True)
    assert first.seen == straight.seen[:7] and len(resumed.seen) == 13
    assert resumed.seen != straight.seen[7:] and resumed.seen == straight.seen[:13]
    assert not torch.equal(resumed.weight, straight.weight)
