"""collective_device: bookkeeping tensors go where the group's backend can move them (CPU for gloo, CUDA for NCCL)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_hetero.comm.devices import backend_moves_cpu_tensors, collective_device


@pytest.mark.parametrize(
    ("backend", "moves_cpu"),
    [
        ("gloo", True),
        ("GLOO", True),
        ("nccl", False),
        ("cpu:gloo,cuda:nccl", True),
        ("cuda:nccl,cpu:gloo", True),
        ("cuda:nccl", False),
        ("cuda:gloo", False),  # gloo registered for CUDA tensors only: a CPU tensor has no backend
        ("mpi", True),
        ("", False),
    ],
)
def test_backend_strings(backend: str, moves_cpu: bool) -> None:
    assert backend_moves_cpu_tensors(backend) is moves_cpu


def test_cpu_without_a_group_and_under_gloo() -> None:
    assert collective_device() == torch.device("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert collective_device() == torch.device("cpu")


def test_a_world_without_a_cpu_backend_refuses_cpu_tensors() -> None:
    """The hazard collective_device exists for, reproduced on the CPU: a world whose only backend serves CUDA
    tensors (as NCCL does) fails on a CPU tensor, while a gloo side group moves it."""
    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.zeros(1))
    side = dist.new_group(backend="gloo")
    flag = torch.ones(1)
    dist.all_reduce(flag, group=side)
    assert flag.tolist() == [1.0]
    assert not backend_moves_cpu_tensors(dist.get_backend())
