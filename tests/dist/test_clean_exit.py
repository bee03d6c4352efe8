"""A process that ends right after gloo collectives exits with 0, not SIGABRT (see ``reliability/shutdown.py``).

Each case runs a fresh interpreter that ends while a gloo worker thread is still to free the last reference to a
collective's tensors, which needs the GIL; a huge switch interval keeps the main thread from handing it over before
interpreter finalization. Measured on the 2-core machine: with ``destroy_process_group`` at exit but without the
drain, this test failed 4 runs of 4; with :func:`destroy_process_group_at_exit` as it is, it passed 5 of 5 (30
processes).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from lightning_hetero.testing.multiprocess import find_free_port

_EXIT_WITH_AN_UNFINISHED_ALL_GATHER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from lightning_hetero.reliability.shutdown import destroy_process_group_at_exit
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    destroy_process_group_at_exit()
    held_elsewhere = dist.new_group([0])  # a group some object still holds at exit, as device meshes do
    sys.setswitchinterval(100.0)
    dist.all_gather_into_tensor(torch.empty({numel}), torch.randn({numel}), group=held_elsewhere, async_op=True)
    """
)


@pytest.mark.timeout(180)
def test_processes_exit_cleanly_while_gloo_workers_still_hold_tensors() -> None:
    # From done before exit starts to still running at exit: which sizes race depends on the machine's speed.
    for numel in (64, 1_000_000, 1_500_000, 2_000_000, 3_000_000, 4_000_000):
        script = _EXIT_WITH_AN_UNFINISHED_ALL_GATHER.format(port=find_free_port(), numel=numel)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, f"{numel} floats: exit code {done.returncode}: {done.stderr[-2000:]}"
