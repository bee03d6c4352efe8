"""Batch shares on fixed measurements: sizes, the share sampler, and token weighting that equals the mean gradient
over the global batch (``lightning_hetero.hetero.batch_share``)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_hetero.data.stateful import StatefulDataLoader
from lightning_hetero.hetero.batch_share import (
    ShareBatchSampler,
    SharedOrder,
    expand_shares,
    gradient_scale,
    micro_batch_sizes,
    plan_micro_batches,
    token_weights,
)
from lightning_hetero.matformer.aggregate import aggregate_gradients
from lightning_hetero.matformer.layout import widths_for
from lightning_hetero.matformer.tiers import contributor_weights, rank_weights


# ---------------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    ("throughputs", "global_batch", "expected"),
    [
        ([3.0, 1.0], 8, [6, 2]),
        ([0.75, 0.25], 8, [6, 2]),
        ([1, 1, 1], 10, [4, 3, 3]),  # a tie: the lower index gets the extra sample
        ([2.0, 1.0, 1.0], 9, [5, 2, 2]),  # ideals 4.5, 2.25, 2.25: the largest remainder
        ([100.0, 1.0, 1.0], 10, [8, 1, 1]),  # the slow ranks stay at the minimum
        ([5.0], 7, [7]),
    ],
)
def test_sizes_are_proportional_and_sum_to_the_global_batch(throughputs, global_batch, expected):
    sizes = micro_batch_sizes(throughputs, global_batch)
    assert sizes == expected and sum(sizes) == global_batch
    assert micro_batch_sizes(throughputs, global_batch) == sizes  # deterministic


def test_sizes_round_within_one_sample_of_the_ideal():
    rates = [3.7, 1.2, 0.9, 2.2, 5.0]
    for global_batch in range(5, 60):
        sizes = micro_batch_sizes(rates, global_batch)
        assert sum(sizes) == global_batch and min(sizes) >= 1
        ideal = [global_batch * r / sum(rates) for r in rates]
        assert all(abs(s - i) < 1 for s, i in zip(sizes, ideal, strict=True) if i >= 1), (global_batch, sizes)


def test_minimum_is_honoured_and_the_rest_stays_proportional():
    assert micro_batch_sizes([10.0, 10.0, 1.0], 12, minimum=3) == [5, 4, 3]
    assert micro_batch_sizes([1.0, 1.0], 4, minimum=2) == [2, 2]


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: micro_batch_sizes([], 4), "throughputs"),
        (lambda: micro_batch_sizes([1.0, 0.0], 4), "throughputs"),
        (lambda: micro_batch_sizes([1.0, float("nan")], 4), "throughputs"),
        (lambda: micro_batch_sizes("fast", 4), "throughputs"),
        (lambda: micro_batch_sizes([1.0, 1.0], 1), "global_batch=1"),
        (lambda: micro_batch_sizes([1.0], 4.0), "global_batch"),
        (lambda: micro_batch_sizes([1.0], 4, minimum=0), "minimum"),
        (lambda: expand_shares([1.0, 2.0, 3.0], 4, 2), "batch_share"),
        (lambda: plan_micro_batches([1.0, 1.0, 1.0], 2, group_size=2), "group_size"),
        (lambda: plan_micro_batches([1.0, 1.0], 0), "batch_size"),
        (lambda: ShareBatchSampler(8, [2, 0], 0), "sizes"),
        (lambda: ShareBatchSampler(8, [2, 2], 2), "rank"),
        (lambda: gradient_scale([2, 2], 5), "rank"),
    ],
)
def test_bad_input_names_the_argument(call, named):
    with pytest.raises(ValueError, match=named):
        call()


def test_shares_per_node_and_per_rank():
    assert expand_shares([3.0, 1.0], world_size=4, num_nodes=2) == [1.5, 1.5, 0.5, 0.5]
    assert expand_shares([1, 2, 3, 4], world_size=4, num_nodes=2) == [1.0, 2.0, 3.0, 4.0]
    # batch_size stays the mean micro-batch: world 4 x 4 = 16 samples per step.
    assert plan_micro_batches(expand_shares([3.0, 1.0], 4, 2), 4) == [6, 6, 2, 2]


def test_one_model_copy_gets_one_size():
    # Two copies of two ranks each; the copy's rate is its ranks' sum, split evenly inside the copy.
    sizes = plan_micro_batches([2.0, 1.0, 1.0, 0.5], 3, group_size=2)
    assert sizes[0] == sizes[1] and sizes[2] == sizes[3] and sum(sizes) == 12
    assert sizes == [4, 4, 2, 2]


def test_token_weights_and_gradient_scale():
    assert token_weights([6, 2]) == [0.75, 0.25]
    assert [gradient_scale([6, 2], r) for r in range(2)] == [1.5, 0.5]
    assert [gradient_scale([4, 4, 4], r) for r in range(3)] == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------------------- sampler
def _epoch(samplers: list[ShareBatchSampler]) -> list[list[list[int]]]:
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_ranks_are_disjoint_cover_the_data_and_take_equal_steps(drop_last):
    sizes = [5, 2, 1]
    samplers = [ShareBatchSampler(40, sizes, rank, seed=3, drop_last=drop_last) for rank in range(3)]
    batches = _epoch(samplers)
    assert {len(b) for b in batches} == {5} and {len(s) for s in samplers} == {5}  # 40 // 8 steps, on every rank
    for rank, rank_batches in enumerate(batches):
        assert all(len(batch) == sizes[rank] for batch in rank_batches)
    seen = [index for rank_batches in batches for batch in rank_batches for index in batch]
    assert sorted(seen) == list(range(40))  # disjoint and complete
    # Step k's global batch is the k-th slice of one shared order, cut in rank order.
    order = list(SharedOrder(40, seed=3))
    for step in range(5):
        assert [i for rank in range(3) for i in batches[rank][step]] == order[8 * step : 8 * step + 8]


def test_sampler_incomplete_last_step_is_dropped_or_padded():
    dropped = _epoch([ShareBatchSampler(10, [3, 1], rank, drop_last=True) for rank in range(2)])
    assert [len(b) for b in dropped] == [2, 2]
    padded = _epoch([ShareBatchSampler(10, [3, 1], rank) for rank in range(2)])
    assert [len(b) for b in padded] == [3, 3] and [len(padded[0][-1]), len(padded[1][-1])] == [3, 1]
    seen = [i for rank in padded for batch in rank for i in batch]
    assert sorted(set(seen)) == list(range(10)) and len(seen) == 12  # two samples from the start, seen again
    order = list(SharedOrder(10))
    assert padded[0][-1] + padded[1][-1] == order[8:] + order[:2]


def test_sampler_epochs_shuffle_the_same_on_every_rank_as_distributed_sampler():
    dataset = TensorDataset(torch.arange(24))
    samplers = [ShareBatchSampler(dataset, [4, 2], rank, seed=7) for rank in range(2)]
    reference = [DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=7) for r in range(2)]
    first = _epoch(samplers)
    for epoch in (0, 1):
        for sampler in [*samplers, *reference]:
            sampler.set_epoch(epoch)
        batches = _epoch(samplers)
        # One step's global batch is the set of samples a DDP step of batch 3 per rank would see, split 4 / 2.
        ddp = [list(s) for s in reference]
        for step in range(4):
            ours = set(batches[0][step] + batches[1][step])
            assert ours == set(ddp[0][3 * step : 3 * step + 3] + ddp[1][3 * step : 3 * step + 3]), (epoch, step)
    assert samplers[0].epoch == 1 and batches != first
    assert list(ShareBatchSampler(6, [2, 1], 0, shuffle=False)) == [[0, 1], [3, 4]]


def test_a_sampler_source_is_cut_as_given():
    source = SharedOrder(12, shuffle=False)
    sampler = ShareBatchSampler(source, [3, 1], 1)
    assert sampler.sampler is source and list(sampler) == [[3], [7], [11]]
    sampler.set_epoch(4)
    assert source.epoch == 4


def test_loader_resumes_mid_epoch_at_the_next_step():
    dataset = TensorDataset(torch.arange(40))

    def loader(rank: int) -> StatefulDataLoader:
        return StatefulDataLoader(dataset, batch_sampler=ShareBatchSampler(len(dataset), [3, 1], rank, seed=1))

    for rank in range(2):
        straight = loader(rank)
        straight.batch_sampler.set_epoch(2)
        expected = [batch[0].tolist() for batch in straight]
        interrupted = loader(rank)
        interrupted.batch_sampler.set_epoch(2)
        head = [batch[0].tolist() for batch in itertools.islice(iter(interrupted), 4)]
        state = interrupted.state_dict()
        assert state["epoch"] == 2 and state["batches_yielded"] == 4
        assert (state["batch_size"], state["num_replicas"]) == (4, 1)  # the global batch, whatever the share
        resumed = loader(rank)
        resumed.load_state_dict(state)
        assert head + [batch[0].tolist() for batch in resumed] == expected


def test_loader_position_converts_from_a_run_without_shares():
    """A DDP run of batch 4 x 2 ranks saved after 3 steps (24 samples) resumes at step 3 of a share run of 8."""
    dataset = TensorDataset(torch.arange(40))
    resumed = StatefulDataLoader(dataset, batch_sampler=ShareBatchSampler(40, [6, 2], 0))
    resumed.load_state_dict({"epoch": 0, "batches_yielded": 3, "batch_size": 4, "num_replicas": 2})
    assert len(list(resumed)) == 2  # 5 steps per epoch, 3 done


# ---------------------------------------------------------------------------------------------------- weighting
def _linear_problem() -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    return model, torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)


def _grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (scale * torch.nn.functional.mse_loss(model(x), y)).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_scaled_mean_all_reduce_equals_the_mean_gradient_of_the_global_batch():
    """FlexDeMo's rule: scale the local loss by W n_r / N; the plain mean over ranks is the full-batch gradient."""
    model, x, y = _linear_problem()
    full = _grads(model, x, y)
    sizes = [6, 2]
    parts = [(x[:6], y[:6]), (x[6:], y[6:])]
    scaled = [_grads(model, *parts[r], scale=gradient_scale(sizes, r)) for r in range(2)]
    mean = [(a + b) / 2 for a, b in zip(*scaled, strict=True)]
    for got, want in zip(mean, full, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    unweighted = [(a + b) / 2 for a, b in zip(*[_grads(model, *parts[r]) for r in range(2)], strict=True)]
    assert not torch.allclose(unweighted[0], full[0])  # without weights the small rank would count three times


def test_token_weighted_region_mean_equals_the_mean_gradient_of_the_global_batch():
    """MatFormer's rule: each rank's weight is tier weight x micro-batch; a region's mean is sum w g / sum w."""
    model, x, y = _linear_problem()
    full = _grads(model, x, y)
    layout = widths_for([0, 0], 8)
    weights = rank_weights(layout, None, rank_scale=[6, 2])
    assert weights == (6.0, 2.0)
    assert rank_weights(layout, [2.0], rank_scale=[6, 2]) == (12.0, 4.0)  # times the tier weight
    assert contributor_weights(layout, 0, rank_scale=[6, 2]).tolist() == [8.0] * 8
    local = [_grads(model, x[:6], y[:6]), _grads(model, x[6:], y[6:])]
    mean = [(weights[0] * a + weights[1] * b) / sum(weights) for a, b in zip(*local, strict=True)]
    for got, want in zip(mean, full, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="rank_scale"):
        rank_weights(layout, None, rank_scale=[6])


def test_aggregate_gradients_takes_rank_scale_in_a_world_of_one():
    grads = {"w": torch.tensor([2.0, -4.0])}
    aggregate_gradients(grads, [], widths_for([0], 8), rank_scale=[5])
    assert grads["w"].tolist() == [2.0, -4.0]  # one rank: its weight cancels
    with pytest.raises(ValueError, match="rank_scale"):
        aggregate_gradients(grads, [], widths_for([0], 8), rank_scale=[1, 2])
