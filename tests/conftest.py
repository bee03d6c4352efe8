"""Shared fixtures: no leaked process groups, offline hub, per-session asset cache."""

from __future__ import annotations

import os

import pytest
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
