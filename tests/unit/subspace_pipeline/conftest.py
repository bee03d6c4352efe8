"""Single-threaded torch for these tiny-model tests: on a shared 2-core machine intra-op threads oversubscribe the
CPU and make a 10-step loop ~25x slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
