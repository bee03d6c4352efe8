"""Which device a small bookkeeping tensor (a flag, a size, a fingerprint) must live on to cross a given group.

gloo moves CPU tensors; NCCL moves only CUDA tensors and fails on a CPU one with ``No backend type associated with
device type cpu``. Lightning starts the world with ``"nccl"`` on CUDA and ``"gloo"`` on the CPU, and a backend may also
be a per-device mix such as ``"cpu:gloo,cuda:nccl"``. Code that builds a tensor only to run a collective on it (not a
model tensor, which already sits on the right device) asks :func:`collective_device` instead of assuming the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["backend_moves_cpu_tensors", "collective_device"]

_CPU_BACKENDS = ("gloo", "mpi", "ucc")


def backend_moves_cpu_tensors(backend: str) -> bool:
    """Whether a ``torch.distributed`` backend string can move CPU tensors.

    ``"gloo"`` / ``"mpi"`` / ``"ucc"``: yes; ``"nccl"``: no; a per-device mix (``"cpu:gloo,cuda:nccl"``): yes exactly
    when it names a backend for device type ``cpu``.
    """
    entries = [entry.strip().lower() for entry in str(backend).split(",") if entry.strip()]
    for entry in entries:
        if ":" in entry:
            device_type, name = entry.split(":", 1)
            if device_type == "cpu" and name:
                return True
        elif entry in _CPU_BACKENDS:
            return True
    return False


def collective_device(group: Any | None = None) -> torch.device:
    """The device for a bookkeeping tensor of a collective over ``group`` (default WORLD).

    The CPU when the group's backend moves CPU tensors (or no process group is initialized), else the current CUDA
    device (an NCCL group).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    if backend_moves_cpu_tensors(dist.get_backend(group)):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
