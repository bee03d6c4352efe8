"""The settings of the fault-tolerant (spot worker) mode: one frozen dataclass, validated on construction.

A strategy that runs its replicate dimension on torchft takes ``fault_tolerance: FaultToleranceSettings | None``
(None: the restart-based path, unchanged). Nothing here imports torchft, so settings can be read, validated and
documented on a machine without the ``ft`` extra.
"""

from __future__ import annotations

import os
import re
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
        quorum_timeout_s: How long one quorum attempt may take (waiting for ``min_replicas`` or the lighthouse)
            before it is asked again, with a ``waiting for replicas`` line, until :attr:`wait_for_replicas_s`. Keep it
            above a step's duration.
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
        quorum_retries: How many times a replica group's manager re-sends a failed quorum request to the lighthouse
            (torchft's ``Manager(quorum_retries=...)``; ``$TORCHFT_QUORUM_RETRIES``, when set, wins), within one
            quorum attempt of ``quorum_timeout_s``; longer lighthouse outages are covered by
            :attr:`wait_for_replicas_s`.
        replica_rank: This replica group's index among :attr:`num_replica_groups`: which shard of the training set
            it reads. None: the trailing digits of the replica id (``REPLICA_GROUP_ID=2`` or ``node-2``: 2), the
            number torchft itself derives from the id.
        num_replica_groups: How many replica groups the job has at most (the nodes, dead or alive). The training
            set is cut into that many disjoint shards, one per group (torchft's ``DistributedSampler``); a shard is
            not read while its group is away. None: every group reads the whole training set in the same order,
            so extra nodes add nothing (a warning says so).
        wait_for_replicas_s: How long survivors wait for ``min_replicas`` replica groups to be present (or for the
            lighthouse), logging ``waiting for replicas: ...`` every ``quorum_timeout_s``. Past it they save a
            checkpoint (the Trainer's ``ModelCheckpoint`` directory, verified by reading it back) and stop with a
            message that says how to resume. None: wait forever.
        secret_file: File holding the cluster secret (the same bytes on every node, at least 16; ``chmod 600``).
            Every slot a replica contributes to a collective, every recovery request and every recovery blob is
            authenticated with an HMAC under it (``lightning_hetero.ft.membership``): a process without it cannot
            contribute a value, heal anyone or read the model. Empty: read :attr:`secret_env`.
        secret_env: Environment variable holding the cluster secret when :attr:`secret_file` is empty. The settings
            hold only where the secret is, never its value (so it is never in a YAML dump, hparams or a log).
        require_secret: Refuse to start without a secret. False: without one the run is open (a warning says so;
            tags then still catch bit-flips and replays, not strangers).
        cluster_id: Bound into every tag, so two runs sharing a secret cannot replay into each other (empty: one
            default id).
        recovery_bind: Address the recovery server binds (e.g. the node's private interface); empty: every
            interface. It answers authenticated members only and the same 404 to everything else.
        outlier_factor: A replica's contribution to a gradient or reduce-wire mean whose norm exceeds this factor
            times the median of the participants' norms is left out of the mean (every replica drops the same slot;
            meaningful with 3 or more participants). 0: off.
    """

    OWNER: ClassVar[str] = "FaultToleranceSettings"

    lighthouse: str = ""
    min_replicas: int = 1
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 30.0
    replica_id_source: str = "env"
    replica_id: str = ""
    replica_id_env: str = "REPLICA_GROUP_ID"
    max_recovery_bytes: int = 0
    max_retries: int | None = None
    quorum_retries: int = 20
    replica_rank: int | None = None
    num_replica_groups: int | None = None
    wait_for_replicas_s: float | None = 600.0
    secret_file: str = ""
    secret_env: str = "LIGHTNING_HETERO_FT_SECRET"
    require_secret: bool = False
    cluster_id: str = ""
    recovery_bind: str = ""
    outlier_factor: float = 10.0

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
        check_int(owner, "quorum_retries", self.quorum_retries, minimum=0, fix="retries of a failed quorum request")
        check_int(owner, "num_replica_groups", self.num_replica_groups, minimum=1, allow_none=True)
        check_int(owner, "replica_rank", self.replica_rank, minimum=0, allow_none=True)
        if None not in (self.replica_rank, self.num_replica_groups) and self.replica_rank >= self.num_replica_groups:
            raise ValueError(
                f"{owner}.replica_rank={self.replica_rank}: use 0 ... num_replica_groups - 1 "
                f"({self.num_replica_groups - 1}), or raise num_replica_groups."
            )
        if self.wait_for_replicas_s is not None:
            check_positive(owner, "wait_for_replicas_s", self.wait_for_replicas_s)
        for name in ("secret_file", "secret_env", "cluster_id", "recovery_bind"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{owner}.{name}={getattr(self, name)!r}: use a string ('' for the default).")
        if not isinstance(self.require_secret, bool):
            raise ValueError(f"{owner}.require_secret={self.require_secret!r}: use True or False.")
        if (
            isinstance(self.outlier_factor, bool)
            or not isinstance(self.outlier_factor, (int, float))
            or not (self.outlier_factor == 0 or self.outlier_factor >= 2)
        ):
            raise ValueError(
                f"{owner}.outlier_factor={self.outlier_factor!r}: use 0 (off) or a factor >= 2 over the median norm"
                " (default 10)."
            )

    def lighthouse_address(self) -> str:
        """:attr:`lighthouse`, else ``TORCHFT_LIGHTHOUSE``; raises naming both when neither is set."""
        address = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not address:
            raise ValueError(
                f"{self.OWNER}.lighthouse is empty and TORCHFT_LIGHTHOUSE is not set: start the lighthouse"
                " (`torchft_lighthouse --min_replicas 2 --bind [::]:29510`) and pass its address."
            )
        return address

    def resolve_replica_rank(self) -> int:
        """This replica group's shard index: :attr:`replica_rank`, else the trailing digits of its id.

        Raises:
            ValueError: The id has no trailing digits, or the index is not below :attr:`num_replica_groups`.
        """
        rank = self.replica_rank
        if rank is None:
            replica_id = self.resolve_replica_id()
            digits = re.search(r"(\d+)$", replica_id)
            if digits is None:
                raise ValueError(
                    f"{self.OWNER}.replica_rank is None and the replica id {replica_id!r} has no trailing digits to "
                    "take it from: name the groups '<name>-<i>' (e.g. REPLICA_GROUP_ID=node-0) or set replica_rank."
                )
            rank = int(digits.group(1))
        if self.num_replica_groups is not None and rank >= self.num_replica_groups:
            raise ValueError(
                f"{self.OWNER}: replica group index {rank} (replica_rank, or the id's trailing digits) is not below "
                f"num_replica_groups={self.num_replica_groups}: a replacement node takes the index of the node it "
                "replaces (0 ... num_replica_groups - 1), or raise num_replica_groups."
            )
        return rank

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
