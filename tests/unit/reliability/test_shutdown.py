"""Process-group teardown at exit: the groups are destroyed and registration happens once (exits: tests/dist)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_hetero.reliability import shutdown
from lightning_hetero.testing.multiprocess import find_free_port


def test_release_destroys_the_default_group() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    shutdown.release_process_groups(drain_seconds=0.0)
    assert not dist.is_initialized()
    shutdown.release_process_groups(drain_seconds=0.0)  # nothing left: a no-op, not an error


def test_at_exit_registration_happens_once(monkeypatch: pytest.MonkeyPatch) -> None:
    registered = []
    monkeypatch.setattr(shutdown, "_AT_EXIT_REGISTERED", False)
    monkeypatch.setattr(shutdown.atexit, "register", registered.append)
    shutdown.destroy_process_group_at_exit()
    shutdown.destroy_process_group_at_exit()
    assert registered == [shutdown.release_process_groups]
