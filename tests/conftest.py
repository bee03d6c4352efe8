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


LAUNCHER_ENVIRONMENT = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)
"""Variables Lightning's launchers write into ``os.environ``. One left behind by an in-process Trainer makes every
later ``lightning-hetero fit`` subprocess believe its ranks are started externally (``LOCAL_RANK`` set): rank 0 then
waits for a rank 1 that is never launched."""


@pytest.fixture(autouse=True)
def _restore_launcher_environment():
    """A test that ran a Trainer in this process must not leak the launcher's variables into the next test."""
    saved = {name: os.environ.get(name) for name in LAUNCHER_ENVIRONMENT}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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
