"""The settings of the fault-tolerant (spot worker) mode: one frozen dataclass, validated on construction.

A strategy that runs its replicate dimension on torchft takes ``fault_tolerance: FaultToleranceSettings | None``
(None: the restart-based path, unchanged). Nothing here imports torchft, so settings can be read, validated and
documented on a machine without the ``ft`` extra.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from lightning_hetero.core.settings import check_choice, check_int, check_positive

__all__ = ["REPLICA_ID_SOURCES", "FaultToleranceSettings"]

REPLICA_ID_SOURCES: tuple[str, ...] = ("env", "hostname", "fixed")
"""Where a replica group's id comes from: an environment variable, the host name, or :attr:`replica_id` itself."""


@dataclass(frozen=True)
class FaultToleranceSettings:
    """How replica groups (nodes) find the lighthouse, how many must be present, and how long anything may take.

    Args:
        lighthouse: Address of the torchft lighthouse, ``http://host:port`` (start it with
            ``torchft_lighthouse --min_replicas 2 --bind [::]:29510``). Empty: read ``TORCHFT_LIGHTHOUSE``.
        min_replicas: Replica groups that must be present for a step to commit; below it training waits (the
            optimizer step is skipped and the quorum retried).
        timeout_s: Limit of every collective, of a recovery transfer and of ``should_commit``: how long the
            survivors wait for a dead or stopped peer before dropping the step in flight.
        quorum_timeout_s: How long one quorum may take (waiting for ``min_replicas``) before it fails.
        connect_timeout_s: Limit for connecting to the lighthouse and the managers.
        replica_id_source: ``"env"`` (the variable named by :attr:`replica_id_env`), ``"hostname"``, or ``"fixed"``
            (:attr:`replica_id`).
        replica_id: The replica group id when ``replica_id_source="fixed"``; its trailing digits are the group's
            number in logs.
        replica_id_env: The environment variable holding the id when ``replica_id_source="env"``.
        max_recovery_bytes: Upper bound of a recovery checkpoint a joining replica accepts, on top of what its own
            state layout allows (0: only the layout bound).
        max_retries: Consecutive uncommitted steps allowed before the step raises ``RuntimeError`` (torchft's
            ``Manager(max_retries=...)``); None: no limit, training waits for enough replicas.
    """

    OWNER: ClassVar[str] = "FaultToleranceSettings"

    lighthouse: str = ""
    min_replicas: int = 1
    timeout_s: float = 60.0
    quorum_timeout_s: float = 120.0
    connect_timeout_s: float = 30.0
    replica_id_source: str = "env"
    replica_id: str = ""
    replica_id_env: str = "REPLICA_GROUP_ID"
    max_recovery_bytes: int = 0
    max_retries: int | None = None

    def __post_init__(self) -> None:
        owner = self.OWNER
        if not isinstance(self.lighthouse, str) or (
            self.lighthouse and not self.lighthouse.startswith(("http://", "https://"))
        ):
            raise ValueError(
                f"{owner}.lighthouse={self.lighthouse!r}: use the lighthouse URL, e.g. 'http://localhost:29510', or ''"
                " to read TORCHFT_LIGHTHOUSE."
            )
        check_int(owner, "min_replicas", self.min_replicas, minimum=1, fix="the replica groups a step needs")
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            check_positive(owner, name, getattr(self, name))
        check_choice(owner, "replica_id_source", self.replica_id_source, REPLICA_ID_SOURCES)
        if self.replica_id_source == "fixed" and not (isinstance(self.replica_id, str) and self.replica_id):
            raise ValueError(
                f"{owner}.replica_id={self.replica_id!r}: replica_id_source='fixed' needs a non-empty id such as"
                " 'node3' (or use replica_id_source='env' / 'hostname')."
            )
        if not isinstance(self.replica_id_env, str) or not self.replica_id_env:
            raise ValueError(f"{owner}.replica_id_env={self.replica_id_env!r}: name an environment variable.")
        check_int(owner, "max_recovery_bytes", self.max_recovery_bytes, minimum=0)
        check_int(owner, "max_retries", self.max_retries, minimum=0, allow_none=True, fix="or None for no limit")

    def lighthouse_address(self) -> str:
        """:attr:`lighthouse`, else ``TORCHFT_LIGHTHOUSE``; raises naming both when neither is set."""
        address = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not address:
            raise ValueError(
                f"{self.OWNER}.lighthouse is empty and TORCHFT_LIGHTHOUSE is not set: start the lighthouse"
                " (`torchft_lighthouse --min_replicas 2 --bind [::]:29510`) and pass its address."
            )
        return address

    def resolve_replica_id(self) -> str:
        """This replica group's id, from :attr:`replica_id_source`."""
        if self.replica_id_source == "fixed":
            return self.replica_id
        if self.replica_id_source == "hostname":
            import socket

            return socket.gethostname()
        value = os.environ.get(self.replica_id_env, "")
        if not value:
            raise ValueError(
                f"{self.OWNER}.replica_id_source='env' but ${self.replica_id_env} is not set: export it per node"
                " (e.g. REPLICA_GROUP_ID=0), or use replica_id_source='fixed' with replica_id."
            )
        return value
