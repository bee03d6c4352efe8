"""Waiting for a quorum: while fewer than ``min_replicas`` replica groups are present, or the lighthouse is down.

torchft's quorum request fails after ``quorum_timeout`` with a raw ``TimeoutError: status: Cancelled`` (or a
transport error once its ``quorum_retries`` against a dead lighthouse are spent), and its Manager then re-raises that
failure on every later ``start_quorum``. :class:`QuorumWait` turns this into waiting: each failed attempt logs one
line (``waiting for replicas: 1 of min_replicas 2 present, deadline in 540 s``) and the quorum is asked again, until
``FaultToleranceSettings.wait_for_replicas_s`` has passed since the wait began; then
:class:`ReplicasBelowMinimumError` says what happened and how to go on. A lighthouse restarted on the same address is
found again by the next attempt, so an outage shorter than the deadline costs a stall and nothing else.

How many replica groups are present is read from the lighthouse's own status page (its ``[N heartbeating]``
count); when the page cannot be read, the line says the lighthouse is unreachable.
"""

from __future__ import annotations

import logging
import re
import time
import urllib.request
from collections.abc import Callable
from datetime import timedelta

from lightning_hetero.ft.settings import FaultToleranceSettings

__all__ = ["QuorumWait", "ReplicasBelowMinimumError", "lighthouse_presence"]

log = logging.getLogger("lightning_hetero.ft")

_HEARTBEATING = re.compile(r"\[(\d+) heartbeating\]")


class ReplicasBelowMinimumError(RuntimeError):
    """Fewer than ``min_replicas`` replica groups (or no lighthouse) for longer than ``wait_for_replicas_s``.

    Attributes:
        waited_s: Seconds waited.
        present: Replica groups heartbeating at the lighthouse at the last look (None: the lighthouse was unreachable).
        checkpoint: Where the caller saved its state before stopping (set by the caller; None if it did not).
    """

    def __init__(self, message: str, waited_s: float, present: int | None) -> None:
        super().__init__(message)
        self.waited_s = waited_s
        self.present = present
        self.checkpoint: str | None = None

    def __str__(self) -> str:
        message = super().__str__()
        if self.checkpoint is None:
            return message
        return (
            f"{message} This node's last committed state is saved and verified in {self.checkpoint}: resume this node "
            f"with `lightning-hetero fit --config <config> --ckpt_path {self.checkpoint}` (Trainer.fit(..., "
            "ckpt_path=...)); nodes started without a checkpoint are healed from it when they join."
        )


def lighthouse_presence(address: str, timeout_s: float = 2.0) -> int | None:
    """Replica groups heartbeating at the lighthouse (from its ``/status`` page), or None when it cannot be read."""
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=timeout_s) as response:  # noqa: S310
            page = response.read(1 << 20).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    match = _HEARTBEATING.search(page)
    return int(match.group(1)) if match else None


class QuorumWait:
    """Runs a quorum request again until it succeeds or ``settings.wait_for_replicas_s`` passed.

    Args:
        settings: ``min_replicas``, ``quorum_timeout_s``, ``wait_for_replicas_s`` and the lighthouse address.
        clock: Monotonic seconds (tests pass a fake one).
        presence: Replica groups present at the lighthouse (default: :func:`lighthouse_presence`).
    """

    def __init__(
        self,
        settings: FaultToleranceSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        presence: Callable[[str], int | None] = lighthouse_presence,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.presence = presence
        self.waited_s = 0.0
        """Seconds the last :meth:`run` spent waiting (0 when the first attempt succeeded)."""

    @property
    def attempt_timeout(self) -> timedelta:
        """One attempt's limit, ``quorum_timeout_s``: also how often the waiting line repeats. Keep it above a step's
        duration: an attempt cut while the others are still computing their step costs them a failed step."""
        return timedelta(seconds=self.settings.quorum_timeout_s)

    def run(self, attempt: Callable[[timedelta], None], reset: Callable[[], None]) -> None:
        """Call ``attempt(timeout)`` until it returns; after each failure call ``reset()``, log, and try again.

        Raises:
            ReplicasBelowMinimumError: Still failing ``wait_for_replicas_s`` after the first failure (the torchft
                error is its ``__cause__``, never shown alone).
        """
        settings = self.settings
        started: float | None = None
        self.waited_s = 0.0
        while True:
            began = self.clock()
            try:
                attempt(self.attempt_timeout)
                if started is not None:
                    self.waited_s = self.clock() - started
                    log.warning("quorum reached after waiting %.0f s; training goes on", self.waited_s)
                return
            except (TimeoutError, RuntimeError) as error:
                if not _quorum_rpc_failure(error):
                    raise
                reset()
                started = began if started is None else started  # the wait began with the first failed attempt
                waited = self.clock() - started
                present = self.presence(settings.lighthouse_address())
                deadline = settings.wait_for_replicas_s
                if deadline is not None and waited >= deadline:
                    raise ReplicasBelowMinimumError(self._give_up_message(waited, present), waited, present) from error
                left = "none" if deadline is None else f"in {deadline - waited:.0f} s"
                if present is None:
                    log.warning(
                        "waiting for the lighthouse: %s is unreachable (%s), deadline %s",
                        settings.lighthouse_address(),
                        _short(error),
                        left,
                    )
                elif present < settings.min_replicas:
                    log.warning(
                        "waiting for replicas: %d of min_replicas %d present, deadline %s",
                        present,
                        settings.min_replicas,
                        left,
                    )
                else:  # enough are heartbeating but not all asked yet (a slow step), or one just left
                    log.warning(
                        "waiting for the quorum: %d replica groups present (min_replicas %d), deadline %s",
                        present,
                        settings.min_replicas,
                        left,
                    )

    def _give_up_message(self, waited: float, present: int | None) -> str:
        settings = self.settings
        if present is None:
            what = f"the lighthouse at {settings.lighthouse_address()} was unreachable"
        elif present < settings.min_replicas:
            what = f"only {present} of min_replicas {settings.min_replicas} replica groups were present"
        else:
            what = f"no quorum formed ({present} replica groups heartbeating, min_replicas {settings.min_replicas})"
        return (
            f"fault-tolerant training stopped: {what} for {waited:.0f} s, past "
            f"FaultToleranceSettings.wait_for_replicas_s={settings.wait_for_replicas_s:g}. Start replacement nodes "
            "(or restart the lighthouse) and resume, or raise wait_for_replicas_s (None: wait forever)."
        )


def _quorum_rpc_failure(error: BaseException) -> bool:
    """A failed quorum request (its timeout, or a gRPC status from a dead lighthouse), not an error of ours."""
    return isinstance(error, TimeoutError) or (type(error) is RuntimeError and "status: " in str(error))


def _short(error: BaseException) -> str:
    """What went wrong, in words (torchft's gRPC status text is noise to a user)."""
    if isinstance(error, TimeoutError):
        return "the quorum request timed out"
    message = re.search(r'message: "([^"]*)"', str(error))
    return f"the quorum request failed: {message.group(1) if message else str(error)[:80]}"
