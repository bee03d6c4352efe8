"""What the fault-tolerant dist tests share: waiting on live processes."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping


def wait_for(
    condition: Callable[[], bool], what: str, procs: Mapping[object, subprocess.Popen], timeout: float = 300.0
) -> None:
    """Poll ``condition`` until true; fail at once naming a process of ``procs`` that exited with an error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for name, proc in procs.items():
            if proc.poll() not in (None, 0):
                raise AssertionError(f"process {name} exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
