"""NCCL readiness without a GPU: run_distributed's NCCL guard, and CPU bookkeeping tensors kept off an NCCL world.

``"cuda:gloo"`` starts a world whose only backend serves CUDA tensors, like NCCL; on a CPU machine it reproduces
NCCL's refusal of CPU tensors (``No backend type associated with device type cpu``) without a GPU.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from lightning_hetero.testing import NotEnoughGPUsError, nccl_unavailable_reason, run_distributed

pytestmark = pytest.mark.timeout(180)


def _cuda_device_and_sum(rank: int, world_size: int) -> tuple[int, float]:
    value = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(value)
    return torch.cuda.current_device(), float(value[0])


def _lowbit_checkpoint_gather_in_an_accelerator_world(rank: int, world_size: int) -> list[list[float]]:
    from lightning_hetero.sparseflip.runtime import _gather_to_every_rank

    residual = torch.full((3,), float(rank))  # the sparseflip residuals live on the CPU
    try:
        _gather_to_every_rank(residual, world_size)  # over the world: what the checkpoint did before the fix
    except RuntimeError as error:
        assert "No backend type associated with device type cpu" in str(error)
    else:
        raise AssertionError("a CPU tensor crossed a world without a CPU backend")
    side = dist.new_group(backend="gloo")  # what SparseFlipRuntime builds when the world is not gloo
    return [t.tolist() for t in _gather_to_every_rank(residual, world_size, side)]


def test_nccl_without_one_gpu_per_rank_is_refused_before_spawning() -> None:
    reason = nccl_unavailable_reason(2)
    if reason is None:
        pytest.skip("this machine has 2 GPUs: the NCCL run below covers it")
    with pytest.raises(NotEnoughGPUsError, match="needs CUDA|one GPU per rank"):
        run_distributed(_cuda_device_and_sum, 2, backend="nccl")
    assert multiprocessing.active_children() == []


def test_nccl_ranks_get_one_gpu_each() -> None:
    reason = nccl_unavailable_reason(2)
    if reason is not None:
        pytest.skip(reason)
    assert run_distributed(_cuda_device_and_sum, 2, backend="nccl", timeout=120) == [(0, 3.0), (1, 3.0)]


def test_sparseflip_checkpoint_gathers_cpu_state_over_its_gloo_group() -> None:
    gathered = run_distributed(_lowbit_checkpoint_gather_in_an_accelerator_world, 2, backend="cuda:gloo", timeout=120)
    assert gathered == [[[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]] * 2
