"""Shared fixtures: no leaked process groups, offline hub, per-session asset cache, and the ``device`` parameter."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _destroy_process_group():
    """A test that initialised a process group in this process must not leak it into the next test."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(params=["cpu", "cuda"], ids=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device a device-agnostic unit test runs on: ``cpu`` always, ``cuda`` only where a GPU is visible.

    The ``cpu`` case is the test as it always ran (``.to(cpu)`` is a no-op, so it costs no extra time); the ``cuda``
    case runs the same body on the current CUDA device and is skipped on a machine without CUDA, so CI never depends
    on a GPU.
    Select the GPU cases alone with ``python3 -m pytest tests/unit -k cuda``.
    """
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available (torch.cuda.is_available() is False): the cuda case needs a GPU.")
    # An indexed device ("cuda:0", not "cuda"), so that ``tensor.device == device`` holds in assertions.
    return torch.device("cuda", torch.cuda.current_device()) if request.param == "cuda" else torch.device("cpu")
