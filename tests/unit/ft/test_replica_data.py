"""Each replica group reads its own shard of one training set (torchft's DistributedSampler per replica group), and a
node healed in place follows the committed step's data position.

Two replica groups are two Trainers run one after the other in this process, each alone at its own lighthouse
(min_replicas 1): what is checked is which batches each one draws, which does not depend on the other being there.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_hetero.data.stateful import StatefulDataLoader
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.replication import ReplicationSettings
from tests.fixtures import quiet_trainer

pytest.importorskip("torchft")

SAMPLES = 50  # not a multiple of 2 groups x 4 per batch: the tail is dropped, never padded with repeats


def _dataset() -> TensorDataset:
    inputs = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(3))
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin(), torch.arange(SAMPLES))


# ------------------------------------------------------------------------------------------------ settings


def test_the_group_index_comes_from_the_replica_id_or_the_setting():
    def settings(**extra):
        return FaultToleranceSettings(replica_id_source="fixed", **extra)

    assert settings(replica_id="node-3", num_replica_groups=4).resolve_replica_rank() == 3
    assert settings(replica_id="7").resolve_replica_rank() == 7
    assert settings(replica_id="node-3", replica_rank=1, num_replica_groups=2).resolve_replica_rank() == 1
    with pytest.raises(ValueError, match="has no trailing digits"):
        settings(replica_id="head").resolve_replica_rank()
    with pytest.raises(ValueError, match="index 4 .* not below num_replica_groups=4: a replacement node takes"):
        settings(replica_id="node-4", num_replica_groups=4).resolve_replica_rank()
    with pytest.raises(ValueError, match=r"replica_rank=2: use 0 \.\.\. num_replica_groups - 1 \(1\)"):
        settings(replica_id="x", replica_rank=2, num_replica_groups=2)
    with pytest.raises(ValueError, match="num_replica_groups=0: use an int >= 1"):
        settings(replica_id="x", num_replica_groups=0)
    with pytest.raises(ValueError, match="quorum_retries=-1: use an int >= 0"):
        settings(replica_id="x", quorum_retries=-1)
    with pytest.raises(ValueError, match="wait_for_replicas_s=0: use a finite number > 0"):
        settings(replica_id="x", wait_for_replicas_s=0)
    assert settings(replica_id="x").quorum_retries > 0, "a lighthouse restart must not kill every node by default"


# ------------------------------------------------------------------------------------------------ the loader


def _ft(group: int, groups: int | None = 2, lighthouse: str = "http://localhost:1") -> FaultToleranceSettings:
    return FaultToleranceSettings(
        lighthouse=lighthouse,
        timeout_s=20,
        replica_id_source="fixed",
        replica_id=f"node-{group}",
        num_replica_groups=groups,
    )


def _shard(group: int, loader: DataLoader, epoch: int = 0) -> list[list[int]]:
    from lightning_hetero.strategies.replica_data import shard_train_loader

    sharded = shard_train_loader(loader, _ft(group), group_rank=0, group_size=1, owner="FlexDeMoStrategy")
    sharded.sampler.set_epoch(epoch)
    return [batch[2].tolist() for batch in sharded]


@pytest.mark.parametrize("epoch", [0, 1])
def test_two_groups_draw_disjoint_shards_of_one_shuffled_order(epoch):
    loaders = [StatefulDataLoader(_dataset(), batch_size=4, shuffle=True, seed=11, drop_last=True) for _ in range(2)]
    shards = [_shard(group, loader, epoch) for group, loader in enumerate(loaders)]
    assert len(shards[0]) == len(shards[1]) == SAMPLES // 2 // 4  # equal batches per epoch: positions line up
    for first, second in zip(*shards, strict=True):
        assert first != second
    drawn = [index for shard in shards for batch in shard for index in batch]
    assert len(drawn) == len(set(drawn)), "a sample is in both shards"
    # One permutation of seed + epoch, dealt out in strides: group g holds positions g, g + 2, ...
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(11 + epoch)).tolist()
    assert [i for batch in shards[1] for i in batch] == order[1::2][: len(drawn) // 2]


def test_an_unshuffled_loader_is_dealt_in_order_and_the_loader_type_is_kept():
    from lightning_hetero.strategies.replica_data import shard_train_loader

    loader = StatefulDataLoader(_dataset(), batch_size=5, shuffle=False)
    sharded = shard_train_loader(loader, _ft(1), group_rank=0, group_size=1, owner="FlexDeMoStrategy")
    assert isinstance(sharded, StatefulDataLoader)
    assert [b[2].tolist() for b in sharded][:2] == [[1, 3, 5, 7, 9], [11, 13, 15, 17, 19]]


def test_ranks_of_a_group_and_the_groups_tile_the_data():
    from lightning_hetero.strategies.replica_data import shard_train_loader

    seen = []
    for group in (0, 1):
        for rank in (0, 1):
            loader = StatefulDataLoader(_dataset(), batch_size=2, shuffle=True, seed=5)
            sharded = shard_train_loader(loader, _ft(group), group_rank=rank, group_size=2, owner="FlexDeMoStrategy")
            seen.extend(i for batch in sharded for i in batch[2].tolist())
    assert len(seen) == len(set(seen)) == SAMPLES - SAMPLES % 4


def test_without_num_replica_groups_the_loader_is_unchanged_and_a_warning_says_why(caplog):
    from lightning_hetero.strategies import replica_data

    loader = StatefulDataLoader(_dataset(), batch_size=4, shuffle=True)
    replica_data._warned_unsharded.discard("Owner")
    with caplog.at_level(logging.WARNING, logger="lightning_hetero"):
        for _ in range(2):
            assert replica_data.shard_train_loader(loader, _ft(0, None), group_rank=0, group_size=1, owner="Owner") is (
                loader
            )
    notes = [r.getMessage() for r in caplog.records if "num_replica_groups is not set" in r.getMessage()]
    assert len(notes) == 1, notes


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


@pytest.mark.parametrize(
    ("loader", "words"),
    [
        (lambda: DataLoader(_Stream()), "has no index to cut"),
        (lambda: DataLoader(_dataset(), sampler=[0, 1, 2]), "has its own sampler (list)"),
        (lambda: DataLoader(_dataset(), batch_sampler=[[0, 1]]), "has its own batch sampler (list)"),
    ],
)
def test_a_loader_that_cannot_be_cut_is_refused_naming_the_setting(loader, words):
    from lightning_hetero.strategies.replica_data import shard_train_loader

    with pytest.raises(ValueError, match=r"num_replica_groups=2\)") as caught:
        shard_train_loader(loader(), _ft(0), group_rank=0, group_size=1, owner="FlexDeMoStrategy")
    assert words in str(caught.value)


def test_a_dataset_smaller_than_the_shards_is_refused():
    from lightning_hetero.ft.data import replica_group_sampler

    with pytest.raises(ValueError, match="has 3 samples, fewer than the 4 shards"):
        replica_group_sampler(list(range(3)), _ft(0), group_size=2)


def test_advance_skips_batches_of_the_epoch_in_progress_at_the_index_level():
    full = [b.tolist() for b in StatefulDataLoader(list(range(20)), batch_size=2, shuffle=True, seed=3)]
    loader = StatefulDataLoader(list(range(20)), batch_size=2, shuffle=True, seed=3)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(2)]
    loader.advance(3)
    assert loader.state_dict()["batches_yielded"] == 5  # a checkpoint now resumes after the skipped batches
    assert head + [b.tolist() for b in iterator] == full[:2] + full[5:]
    loader = StatefulDataLoader(list(range(20)), batch_size=2)
    iterator = iter(loader)
    next(iterator)
    loader.advance(50)
    assert list(iterator) == [] and loader.state_dict()["epoch"] == 1
    with pytest.raises(ValueError, match="positions only move forward"):
        loader.advance(-1)


# ------------------------------------------------------------------------------------------------ in the Trainer


class _Indexed(__import__("lightning").LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.seen: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        inputs, target, index = batch
        self.seen.append((self.current_epoch, batch_idx, index.tolist()))
        return torch.nn.functional.mse_loss(self.net(inputs), target)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


@pytest.fixture
def lighthouse():
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    yield server
    server.shutdown()


def _fit(ft: FaultToleranceSettings, steps: int, **trainer_args) -> _Indexed:
    from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy

    settings = FlexDeMoSettings(replication=ReplicationSettings(kind="demo", chunk=4), fault_tolerance=ft)
    module = _Indexed()
    trainer = quiet_trainer(devices=1, strategy=FlexDeMoStrategy(settings=settings), max_steps=steps, **trainer_args)
    trainer.fit(module, StatefulDataLoader(_dataset(), batch_size=4, shuffle=True, seed=2, drop_last=True))
    return module


@pytest.mark.timeout(180)
@pytest.mark.parametrize("distributed_sampler", [True, False], ids=["lightning-sampler", "own-sampler"])
def test_two_trainer_replica_groups_train_different_batches_every_step_and_never_the_same_sample(
    lighthouse, distributed_sampler
):
    steps = 2 * (SAMPLES // 2 // 4)  # two epochs of each shard
    seen = [
        _fit(_ft(group, lighthouse=lighthouse.address()), steps, use_distributed_sampler=distributed_sampler).seen
        for group in (0, 1)
    ]
    assert [(e, b) for e, b, _ in seen[0]] == [(e, b) for e, b, _ in seen[1]]  # the same positions, step by step
    for first, second in zip(*seen, strict=True):
        assert first[2] != second[2]
    for epoch in (0, 1):
        drawn = [i for s in seen for e, _, batch in s if e == epoch for i in batch]
        assert len(drawn) == len(set(drawn)) == SAMPLES - SAMPLES % 8, f"epoch {epoch}: a sample trained twice"
