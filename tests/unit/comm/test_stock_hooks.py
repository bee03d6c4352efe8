"""The counting DDP comm hook and FSDP2 comms in one process (a gloo world of one; 2-rank byte counts are checked
against hand arithmetic in ``tests/usercode/test_comm_monitor.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from lightning_hetero.comm import INTRA, ByteLedger
from lightning_hetero.comm.collectives import CountedFSDPAllGather, CountedFSDPReduceScatter
from lightning_hetero.comm.ddp_hook import ddp_uncounted_traffic, register_counted_allreduce
from lightning_hetero.comm.fsdp_comm import count_fsdp2
from lightning_hetero.testing import find_free_port


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def test_ddp_hook_records_every_bucket_it_all_reduces(world_of_one: None) -> None:
    ledger = ByteLedger()
    model = DistributedDataParallel(_net())
    state = register_counted_allreduce(model, INTRA, ledger)
    assert register_counted_allreduce(model, INTRA, ledger) is state  # idempotent per model
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
    grads = sum(p.numel() for p in model.parameters())
    records = ledger.records()
    assert {r.op for r in records} == {"all_reduce"} and {r.label for r in records} == {INTRA}
    assert sum(r.payload_bytes for r in records) == 2 * grads * 4  # every float32 gradient, both steps
    assert sum(r.sent for r in records) == 0  # a world of one puts nothing on the wire
    assert state.buckets == len(records) >= 2
    assert all(p.grad is not None for p in model.parameters())
    # BatchNorm's running stats are broadcast before every forward: said, not counted
    assert any("buffer" in item for item in ddp_uncounted_traffic(model))


def test_ddp_hook_refuses_what_it_cannot_count(world_of_one: None) -> None:
    with pytest.raises(TypeError, match=r"register_counted_allreduce\(model=...\) needs a DistributedDataParallel"):
        register_counted_allreduce(_net(), INTRA)  # type: ignore[arg-type]
    model = DistributedDataParallel(_net())
    model.register_comm_hook(None, lambda state, bucket: torch.futures.Future())  # the user's own hook
    with pytest.raises(RuntimeError):
        register_counted_allreduce(model, INTRA)


class _UsersAllGather:
    """A comm someone else installed (any class but FSDP's defaults and ours): never replaced."""

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output: torch.Tensor, input: torch.Tensor, group: object, async_op: bool = False) -> None:
        output.copy_(input)  # a world of one


def test_count_fsdp2_installs_counting_comms_once_and_leaves_foreign_ones(world_of_one: None) -> None:
    net = _net()
    fully_shard(net[0])
    fully_shard(net)
    coverage = count_fsdp2(net, INTRA)
    assert sorted(coverage.counted) == ["0", "<root>"] and not coverage.uncounted and not coverage.hsdp
    assert count_fsdp2(net, INTRA).counted == coverage.counted  # idempotent
    other = _net()
    fully_shard(other)
    other.set_custom_all_gather(_UsersAllGather())  # type: ignore[arg-type]
    left = count_fsdp2(other, INTRA)
    assert left.counted == [] and "_UsersAllGather" in left.uncounted["<root>"]
    assert type(other._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm).__name__ == "DefaultReduceScatter"


def test_fsdp2_comms_record_what_fsdp_hands_them(world_of_one: None) -> None:
    ledger = ByteLedger()
    gather, scatter = CountedFSDPAllGather(INTRA, ledger), CountedFSDPReduceScatter(INTRA, ledger)
    flat = gather.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    assert flat.shape == (6,)
    output = torch.empty(6)
    assert gather(output, torch.arange(6.0), dist.group.WORLD) is None
    assert output.tolist() == list(range(6))
    reduced = torch.empty(6)
    scatter(reduced, torch.ones(6), dist.group.WORLD, dist.ReduceOp.SUM)
    assert reduced.tolist() == [1.0] * 6
    assert [(r.op, r.payload_bytes) for r in ledger.records()] == [
        ("all_gather_into_tensor", 24),
        ("reduce_scatter_tensor", 24),
    ]
