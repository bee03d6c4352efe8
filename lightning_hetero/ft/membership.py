"""Membership of a spot run by a cluster secret: HMAC-SHA256 over everything our code sends on the fault-tolerant path.

torchft's lighthouse and managers are compiled and speak their own unauthenticated protocol: any process that reaches
the lighthouse can join a quorum. What we control is authenticated instead:

- every replica's contribution to a collective is a **slot** ``payload || tag``: ``tag`` is an HMAC-SHA256
  (:data:`MAC_BYTES` = 32 bytes) over the cluster id, the committed step, the quorum id, the participant count, the
  slot index, the collective's sequence number in the step and the payload (:class:`SlotContext`,
  :meth:`ClusterSecret.slot_tag`). A slot whose tag does not verify came from a process without the secret, or was
  altered on the wire; a slot of an earlier step, quorum or collective, or copied to another slot, does not verify
  either (replay);
- a request to a recovery server carries a fresh nonce and an HMAC over the cluster id, the step and the nonce
  (:meth:`ClusterSecret.request_token`); the blob served back is tagged over the cluster id, the step, the quorum id,
  the nonce and the blob (:meth:`ClusterSecret.blob_tagger`).

The secret comes from a file (:attr:`FaultToleranceSettings.secret_file`) or an environment variable
(:attr:`FaultToleranceSettings.secret_env`); the settings hold only where it is, so it never reaches a YAML dump, the
hyper-parameters or a log line, and :class:`ClusterSecret` has a redacted ``repr`` and refuses to be pickled. Without a
secret (and ``require_secret=False``) the run is **open**: the tags use a public key, which still detects bit-flips on
the wire and replays, but not strangers; a warning says so.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MAC_BYTES",
    "MIN_SECRET_BYTES",
    "OPEN_KEY",
    "ClusterSecret",
    "SlotContext",
    "load_secret",
]

log = logging.getLogger("lightning_hetero.ft")

MAC_BYTES = 32
"""Bytes of one tag (HMAC-SHA256): the wire cost per slot."""
MIN_SECRET_BYTES = 16
"""Shortest secret accepted (128 bits); e.g. ``python -c "import secrets; print(secrets.token_hex(32))"``."""
OPEN_KEY = b"lightning_hetero.ft/open-membership"
"""The public key of an open run (no secret): tags then detect corruption and replay, not strangers."""
_SLOT, _REQUEST, _BLOB = b"slot", b"request", b"blob"  # domain separation: a tag of one kind never verifies as another


@dataclass(frozen=True)
class SlotContext:
    """What a slot's tag binds besides the payload: the same on every participant of one collective."""

    cluster: str
    step: int
    quorum: int
    count: int
    sequence: int

    def header(self, slot: int) -> bytes:
        """The tagged fields of slot ``slot`` as fixed-width bytes (then the payload follows)."""
        cluster = self.cluster.encode()
        return (
            struct.pack("<4q", self.step, self.quorum, self.count, self.sequence)
            + struct.pack("<qI", slot, len(cluster))
            + cluster
        )


class ClusterSecret:
    """The key every member holds. ``repr``/``str`` never show it; it cannot be pickled or deep-copied into a dump.

    Args:
        key: The secret bytes (at least :data:`MIN_SECRET_BYTES`), or :data:`OPEN_KEY` for an open run.
        source: Where it came from, for logs (``"file /path"``, ``"$VAR"`` or ``"open"``), never the value.
    """

    __slots__ = ("_key", "source")

    def __init__(self, key: bytes, source: str) -> None:
        if not isinstance(key, bytes) or (key != OPEN_KEY and len(key) < MIN_SECRET_BYTES):
            raise ValueError(
                f"the cluster secret from {source} has {len(key) if isinstance(key, bytes) else '?'} bytes; use at"
                f' least {MIN_SECRET_BYTES} random bytes (e.g. `python -c "import secrets;'
                ' print(secrets.token_hex(32))"`).'
            )
        self._key = key
        self.source = source

    @property
    def open(self) -> bool:
        """True without a secret: strangers are not kept out (tags still catch corruption and replay)."""
        return self._key == OPEN_KEY

    def __repr__(self) -> str:
        return f"ClusterSecret(<redacted>, source={self.source!r})"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a ClusterSecret is never pickled or serialized: load it from its file or variable")

    def __deepcopy__(self, memo: dict[int, Any]) -> ClusterSecret:
        return self

    def _mac(self, kind: bytes, *parts: bytes) -> hmac.HMAC:
        mac = hmac.new(self._key, kind, hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac

    # ------------------------------------------------------------------------------------------------ slots
    def slot_tag(self, context: SlotContext, slot: int, payload: bytes | memoryview) -> bytes:
        """The :data:`MAC_BYTES` tag of ``payload`` in slot ``slot`` of the collective ``context``."""
        return self._mac(_SLOT, context.header(slot), payload).digest()

    def slot_ok(self, context: SlotContext, slot: int, payload: bytes | memoryview, tag: bytes | memoryview) -> bool:
        """Whether ``tag`` is this slot's tag (constant-time comparison)."""
        return hmac.compare_digest(self.slot_tag(context, slot, payload), bytes(tag))

    # ------------------------------------------------------------------------------------------------ recovery
    def request_token(self, cluster: str, step: int, nonce: str) -> str:
        """Hex tag of a recovery request for ``step`` with the requester's ``nonce``."""
        return self._mac(_REQUEST, _fields(cluster, step), nonce.encode()).hexdigest()

    def request_ok(self, cluster: str, step: int, nonce: str, token: str) -> bool:
        """Whether ``token`` authenticates a request for ``step`` with ``nonce``."""
        return hmac.compare_digest(self.request_token(cluster, step, nonce), token)

    def blob_tagger(self, cluster: str, step: int, blob: bytes) -> hmac.HMAC:
        """An HMAC over everything of a served blob but the nonce: copy it and add the nonce per request (the blob is
        hashed once however many peers ask). No quorum id: the request's fresh nonce already makes every answer
        unique, and source and joiner may read different quorum ids while a quorum re-forms (an honest heal was
        refused that way in the spot recipe)."""
        return self._mac(_BLOB, _fields(cluster, step), blob)

    @staticmethod
    def finish_blob_tag(tagger: hmac.HMAC, nonce: str) -> str:
        """Hex tag of a served blob for one request's ``nonce``."""
        mac = tagger.copy()
        mac.update(nonce.encode())
        return mac.hexdigest()


def _fields(cluster: str, step: int) -> bytes:
    encoded = cluster.encode()
    return struct.pack("<qI", step, len(encoded)) + encoded


def load_secret(
    secret_file: str, secret_env: str, *, required: bool, owner: str = "FaultToleranceSettings"
) -> ClusterSecret:
    """The cluster secret from ``secret_file`` (when set) or ``$secret_env``; an open run's key when neither is set.

    Raises:
        ValueError: The file is missing or empty, the secret is shorter than :data:`MIN_SECRET_BYTES`, or neither is
            set while ``required``; the message names the setting and the fix, never the secret.
    """
    if secret_file:
        path = Path(secret_file).expanduser()
        try:
            key = path.read_bytes().strip()
        except OSError as error:
            raise ValueError(
                f"{owner}.secret_file={secret_file!r} cannot be read ({error.strerror}): write the cluster secret there"
                " on every node (the same bytes), readable by the training user only."
            ) from None
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s.secret_file %s is readable by other users: chmod 600 it.", owner, secret_file)
        return ClusterSecret(key, f"file {secret_file}")
    value = os.environ.get(secret_env, "") if secret_env else ""
    if value:
        return ClusterSecret(value.encode(), f"${secret_env}")
    if required:
        raise ValueError(
            f"{owner}(require_secret=True): no cluster secret: set {owner}.secret_file to a file holding it, or export"
            f" ${secret_env or 'LIGHTNING_HETERO_FT_SECRET'} on every node (the same value, at least"
            f" {MIN_SECRET_BYTES} bytes)."
        )
    log.warning(
        "fault-tolerant run without a cluster secret (%s.secret_file empty, $%s unset): membership is OPEN, any"
        " process that reaches the lighthouse can join and contribute; wire corruption and replays are still"
        " detected. Set the secret to keep strangers out (docs/reliability.md, threat model).",
        owner,
        secret_env,
    )
    return ClusterSecret(OPEN_KEY, "open")
