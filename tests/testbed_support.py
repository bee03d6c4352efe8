"""Whether the bandwidth testbed can run here: tests that need it skip with the reason instead of failing."""

from __future__ import annotations

import os
import subprocess

import pytest


def testbed_skip_reason(*, probe_namespaces: bool = False) -> str | None:
    """Why the testbed cannot run here (no root, no iproute2, no namespaces), or None when it can.

    Args:
        probe_namespaces: Also create and delete one throw-away namespace (containers may forbid it).
    """
    from lightning_hetero.testbed.checks import TestbedConfigError, check_environment

    try:
        check_environment()
    except TestbedConfigError as error:
        return str(error)
    if probe_namespaces:
        probe = f"lhtb-{os.getpid():x}-probe"
        created = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if created.returncode != 0:
            return f"cannot create network namespaces here: {created.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_testbed(*, probe_namespaces: bool = False) -> None:
    """Skip the calling test when the testbed cannot run here."""
    reason = testbed_skip_reason(probe_namespaces=probe_namespaces)
    if reason:
        pytest.skip(reason)
