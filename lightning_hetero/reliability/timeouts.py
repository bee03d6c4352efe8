"""One collective timeout for every process group of a job, and a clear message when a collective times out.

``torch.distributed.init_process_group(timeout=...)`` sets the timeout of the default group only. Groups created
later with ``new_group`` or ``init_device_mesh`` without a timeout get torch's default (30 minutes for gloo, 10 for
NCCL), so a hung peer inside a FlexDeMo mesh group, a subspace pipeline group or a MatFormer region group would
block the others for half an hour whatever the strategy's ``timeout`` says (measured: a 3 s default group, a
``new_group`` without timeout, one rank sleeping: no error until the sleeper closed its connection 30 s later).
:func:`inherit_group_timeout` makes every later group default to the job's timeout instead.
"""

from __future__ import annotations

import re
from datetime import timedelta

import torch.distributed.distributed_c10d as c10d

__all__ = ["explain_collective_error", "group_default_timeout", "inherit_group_timeout"]

_TIMEOUT_PATTERNS = (
    re.compile(r"Timed out waiting \d+ms", re.IGNORECASE),
    re.compile(r"Watchdog caught collective operation timeout", re.IGNORECASE),
    re.compile(r"timed out|timeout", re.IGNORECASE),
)
_PEER_GONE_PATTERNS = (
    # gloo closes every pair of a timed-out op itself ("Application timeout caused pair closure"): a timeout.
    re.compile(
        r"Connection closed by peer|Connection reset by peer|Broken pipe|(?<!timeout caused )pair closure",
        re.IGNORECASE,
    ),
)


def inherit_group_timeout(timeout: timedelta | None) -> None:
    """Make ``timeout`` the default of every process group created from now on in this process (``new_group``,
    ``init_device_mesh``, ``split_group`` without an explicit timeout), for every backend.

    torch reads the defaults from module attributes of ``torch.distributed.distributed_c10d`` each time a group is
    created; this sets them. ``None`` leaves torch's defaults.
    """
    if timeout is None:
        return
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}.")
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout


def group_default_timeout() -> timedelta:
    """The timeout a group created now without one would get (gloo/other backends)."""
    return c10d._get_default_timeout(c10d.Backend.GLOO)


def explain_collective_error(error: BaseException, timeout: timedelta | None = None) -> str | None:
    """A one-paragraph explanation of a collective failure caused by an unresponsive or dead peer, or None.

    Recognizes gloo's and NCCL's timeout messages ("Timed out waiting ...ms", the NCCL watchdog) and a peer that
    closed its connection (crashed or killed).
    """
    text = f"{type(error).__name__}: {error}"
    limit = f" ({timeout.total_seconds():g} s, the strategy's timeout)" if timeout is not None else ""
    if any(p.search(text) for p in _PEER_GONE_PATTERNS):
        return (
            "A collective failed because a peer closed its connection: another rank crashed or was killed. "
            "Under torchrun with --max-restarts >= 1 the job restarts from the last good checkpoint. "
            f"Original error: {text[:300]}"
        )
    if any(p.search(text) for p in _TIMEOUT_PATTERNS):
        return (
            f"A collective timed out{limit}: a peer stopped answering (hung, stopped, overloaded, or its link is "
            "down). Under torchrun with --max-restarts >= 1 the job restarts from the last good checkpoint; raise "
            f"the strategy's timeout if peers are merely slow. Original error: {text[:300]}"
        )
    return None
