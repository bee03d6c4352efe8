"""The replica drift guard shared by FlexDeMo and SparseFlip: checksums, and the verdict every rank raises."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_hetero.core.drift import ReplicaDriftError, check_replica_drift, tensor_checksum
from lightning_hetero.testing import run_distributed


def test_checksum_sees_every_bit_and_position():
    tensor = torch.randn(5, 7)
    base = tensor_checksum(tensor)
    flipped = tensor.clone()
    flipped.view(torch.int32)[2, 3] ^= 1  # one mantissa bit
    assert not torch.equal(base, tensor_checksum(flipped))
    swapped = tensor.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert not torch.equal(base, tensor_checksum(swapped))
    assert torch.equal(tensor_checksum(torch.empty(0, 3)), torch.zeros(2, dtype=torch.int64))


def test_one_replica_checks_nothing():
    check_replica_drift([("w", torch.ones(2))], 1, owner="X", num_replicas=1)  # no process group needed


def _guard(rank: int, world_size: int, shard_size: int) -> list[str]:
    """Replica layout ``rank = replica * shard_size + shard``; rank ``world_size - 1`` drifts in its second tensor."""
    group = None
    if shard_size > 1:  # every rank creates every replicate group, in the same order
        groups = [dist.new_group(list(range(s, world_size, shard_size))) for s in range(shard_size)]
        group = groups[rank % shard_size]
    named = [("a", torch.arange(4.0) + rank % shard_size), ("b", torch.ones(3, dtype=torch.bfloat16))]
    kwargs = {"owner": "Tester", "num_replicas": world_size // shard_size, "replicate_group": group}
    check_replica_drift(named, 5, shard_size=shard_size, **kwargs)  # shards differ, replicas agree: fine
    messages = []
    if rank == world_size - 1:
        named[1][1][0] += 1
    try:
        check_replica_drift(named, 6, shard_size=shard_size, **kwargs)
    except ReplicaDriftError as error:
        messages.append(str(error))
    return messages


def test_every_rank_raises_the_same_message_naming_step_parameter_and_ranks():
    for world_size, shard_size, bad, reference in ((2, 1, 1, 0), (4, 2, 3, 1)):
        results = run_distributed(_guard, world_size, shard_size, timeout=120)
        assert [len(r) for r in results] == [1] * world_size  # every rank raised, not only the drifting one
        assert len({r[0] for r in results}) == 1
        message = results[0][0]
        assert message.startswith("Tester replica drift at optimizer step 6: parameter 'b'")
        assert f"rank(s) [{bad}]" in message and f"to rank {reference} " in message
