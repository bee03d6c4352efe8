"""A torchft ``CheckpointTransport`` that never unpickles: safetensors plus validated JSON over HTTP.

torchft's stock transports unpickle what a peer sends (``pickle.loads`` in the process-group transport,
``torch.load(weights_only=False)`` in the HTTP one). :class:`SafeCheckpointTransport` replaces them for our
managers: a replica asked to heal a peer encodes its state once with :func:`~lightning_hetero.ft.codec.encode_state`
(a snapshot, so later in-place updates cannot leak into what is served) and serves the bytes over HTTP; the joining
replica fetches at most the bytes its own layout allows and decodes them with
:func:`~lightning_hetero.ft.codec.decode_state`, which refuses anything off its own layout with
:class:`~lightning_hetero.comm.validation.PeerPayloadError` naming the source replica and the field.

Membership (:mod:`lightning_hetero.ft.membership`): a request carries a fresh nonce and its HMAC under the cluster
secret (headers ``X-LH-Nonce``, ``X-LH-Token``); the server answers only such a request, once per nonce, and gives
everything else (no token, a wrong one, a replayed nonce, another path, a step it does not serve) the same empty
404, so a stranger learns nothing, not even the step served. The blob comes back with an HMAC over the cluster id,
the step, the request's nonce and the blob (``X-LH-Tag``); the joiner verifies it before decoding, so
a forged heal from a stranger, or a blob altered on the wire, is refused (:class:`UnauthenticatedPeerError`). Such a
refusal is not kept in :attr:`SafeCheckpointTransport.last_error`: the Manager discards the step, the joiner keeps its
own state and the next quorum tries again (torchft, not us, picks the source replica: a retry gets another source
only when the quorum changes), so a stranger cannot stop an honest replica. A member's blob that authenticates but
breaks the rule (another layout, hyper-parameters, moments, steps, RNG: :mod:`lightning_hetero.ft.checks`) is a
misconfiguration and is raised.
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lightning_hetero.comm.validation import PeerPayloadError, check_announced_size
from lightning_hetero.ft._deps import require_torchft
from lightning_hetero.ft.codec import StateLayout, blob_limit, decode_state, encode_state
from lightning_hetero.ft.membership import OPEN_KEY, ClusterSecret

require_torchft()

from torchft.checkpointing.transport import CheckpointTransport  # noqa: E402 - after the clear ImportError

__all__ = ["SafeCheckpointTransport", "UnauthenticatedPeerError"]

log = logging.getLogger("lightning_hetero.ft")
_MAX_ADDRESS_CHARS = 512
_NONCE, _TOKEN, _TAG = "X-LH-Nonce", "X-LH-Token", "X-LH-Tag"
_NONCE_CHARS = 32  # 16 random bytes in hex
_SEEN_NONCES = 4096  # a replayed request is refused while its nonce is among the last this many


class UnauthenticatedPeerError(PeerPayloadError):
    """A recovery blob whose tag does not verify: from a process without the cluster secret, or altered on the wire."""


class SafeCheckpointTransport(CheckpointTransport[dict[str, Any]]):
    """Serve this replica's state to joining peers and fetch a peer's state when joining, without pickle.

    Args:
        layout: Returns the receiver's own state layout (:class:`~lightning_hetero.ft.codec.StateLayout`) in the
            form the Manager hands over (``{"user": {...}, "torchft": {...}}``); called once per recovery.
        timeout: Limit of one transfer.
        host: Name peers use to reach this replica's server (default: this host's name).
        max_bytes: Upper bound of an accepted recovery blob beyond the layout's own bound (0: layout only).
        secret: The cluster secret (default: an open run's public key).
        cluster: The cluster id bound into every tag.
        bind: Address the server binds (empty: every interface).
        validate: Called with ``(state, peer, step)`` on a decoded state before it is returned (the joiner's semantic
            checks, :func:`lightning_hetero.ft.checks.validate_recovered`); raises to refuse it.
    """

    def __init__(
        self,
        layout: Callable[[], StateLayout],
        *,
        timeout: timedelta = timedelta(seconds=60),
        host: str | None = None,
        max_bytes: int = 0,
        secret: ClusterSecret | None = None,
        cluster: str = "",
        bind: str = "",
        validate: Callable[[Any, int, int], None] | None = None,
    ) -> None:
        self._layout = layout
        self._secret = secret if secret is not None else ClusterSecret(OPEN_KEY, "open")
        self._cluster = cluster
        self._validate = validate
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.refused_requests = 0
        """Requests answered 404 without authentication (strangers, replays, malformed)."""
        self.refused_heals = 0
        """Recovery blobs refused because their tag did not verify."""
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._ready = threading.Condition()
        self._served: tuple[int, bytes, Any] | None = None  # step, blob, its tagger (HMAC state without the nonce)
        self.last_error: PeerPayloadError | None = None
        """The last refused recovery (the Manager only logs errors of a recovery; the replica layer re-raises it)."""
        transport = self

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                nonce = transport._authenticated(self.path, self.headers.get(_NONCE), self.headers.get(_TOKEN))
                wanted = self.path.rpartition("/")[2]
                served = None
                if nonce is not None:
                    # The joining replica may ask before this replica's quorum thread has encoded the step: wait.
                    with transport._ready:
                        transport._ready.wait_for(
                            lambda: transport._served is not None and str(transport._served[0]) == wanted,
                            timeout=transport._timeout.total_seconds(),
                        )
                        served = transport._served
                if nonce is None or served is None or str(served[0]) != wanted:
                    self.send_response(404)  # the same empty answer to everything: reveals nothing
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(served[1])))
                self.send_header(_TAG, ClusterSecret.finish_blob_tag(served[2], nonce))
                self.end_headers()
                self.wfile.write(served[1])

            def do_POST(self) -> None:  # noqa: N802 - every other method gets the same 404
                transport._not_found(self)

            do_PUT = do_DELETE = do_HEAD = do_POST  # noqa: N815

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                log.debug("checkpoint server: " + format, *args)

        self._server = ThreadingHTTPServer((bind, 0), _Handler)
        self._server.daemon_threads = True
        self._host = host or socket.gethostname()
        self._thread = threading.Thread(target=self._server.serve_forever, name="ft-checkpoint-server", daemon=True)
        self._thread.start()

    def _authenticated(self, path: str, nonce: str | None, token: str | None) -> str | None:
        """The request's nonce when it is an authenticated, fresh request for ``/checkpoint/<step>``; else None."""
        parts = path.strip("/").split("/")
        ok = (
            len(parts) == 2
            and parts[0] == "checkpoint"
            and parts[1].isdigit()
            and len(parts[1]) < 20
            and isinstance(nonce, str)
            and len(nonce) == _NONCE_CHARS
            and isinstance(token, str)
            and len(token) == 64
            and self._secret.request_ok(self._cluster, int(parts[1]), nonce, token)
        )
        with self._ready:
            if ok and nonce not in self._seen:
                self._seen[nonce] = None
                while len(self._seen) > _SEEN_NONCES:
                    self._seen.popitem(last=False)
                return nonce
            self.refused_requests += 1
        log.debug("recovery server: refused an unauthenticated or replayed request")
        return None

    @staticmethod
    def _not_found(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(404)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def metadata(self) -> str:
        """Where peers fetch this replica's checkpoint (the step is appended)."""
        return f"http://{self._host}:{self._server.server_address[1]}/checkpoint/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta) -> None:
        """Encode ``state_dict`` now (a snapshot) and serve it for ``step`` until the next send or shutdown."""
        blob = encode_state(state_dict, step)
        tagger = self._secret.blob_tagger(self._cluster, step, blob)
        with self._ready:
            self._served = (step, blob, tagger)
            self._ready.notify_all()
        log.info("serving the recovery checkpoint of step %d (%d bytes) to replicas %s", step, len(blob), dst_ranks)

    def disallow_checkpoint(self) -> None:
        """Nothing to do: what is served is an immutable snapshot of its step, never the live state."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        """Fetch and decode replica ``src_rank``'s checkpoint of ``step`` from ``metadata`` (its server's address).

        Raises:
            PeerPayloadError: The address, the size or anything in the blob breaks the rule; also kept in
                :attr:`last_error`.
        """
        try:
            return self._receive(src_rank, metadata, step, timeout)
        except UnauthenticatedPeerError as error:
            self.refused_heals += 1
            log.error("%s The step is discarded; this replica keeps its own state and tries again.", error)
            raise
        except PeerPayloadError as error:
            self.last_error = error
            raise

    def _receive(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        if not (isinstance(metadata, str) and metadata.startswith("http://") and len(metadata) <= _MAX_ADDRESS_CHARS):
            raise PeerPayloadError(
                f"replica {src_rank} announced checkpoint address {str(metadata)[:80]!r}, not an http:// URL; refusing"
                " it.",
                src_rank,
                "metadata",
            )
        layout = self._layout()
        limit = blob_limit(layout, self._max_bytes)
        url = f"{metadata}{int(step)}"
        nonce = secrets.token_hex(_NONCE_CHARS // 2)
        request = urllib.request.Request(
            url, headers={_NONCE: nonce, _TOKEN: self._secret.request_token(self._cluster, int(step), nonce)}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:  # noqa: S310 - http only
                tag = response.headers.get(_TAG)
                announced = response.headers.get("Content-Length")
                if announced is not None:
                    check_announced_size(
                        int(announced) if announced.isdigit() else announced,
                        limit,
                        peer=src_rank,
                        what="recovery checkpoint Content-Length",
                    )
                blob = response.read(limit + 1)
        except urllib.error.URLError as error:
            # Not a payload fault: the peer went away or refused; the Manager retries at the next quorum.
            raise ConnectionError(
                f"fetching the recovery checkpoint from replica {src_rank} ({url}): {error}"
            ) from error
        if len(blob) > limit:
            raise PeerPayloadError(
                f"recovery checkpoint from replica {src_rank} is larger than the {limit} bytes this replica's own state"
                " allows; refusing it.",
                src_rank,
                "size",
            )
        return self.accept(blob, tag, nonce, src_rank=src_rank, step=int(step), layout=layout)

    def accept(self, blob: bytes, tag: str | None, nonce: str, *, src_rank: int, step: int, layout: StateLayout) -> Any:
        """What a fetched blob goes through, in order: its tag (under this request's ``nonce``), the codec against
        ``layout``, then the joiner's semantic checks; the state is returned only if all pass.

        Raises:
            UnauthenticatedPeerError: The tag is missing or wrong.
            PeerPayloadError: The blob breaks the codec's rule or the joiner's checks.
        """
        expected = ClusterSecret.finish_blob_tag(self._secret.blob_tagger(self._cluster, step, blob), nonce)
        if not (isinstance(tag, str) and hmac.compare_digest(tag, expected)):
            raise UnauthenticatedPeerError(
                f"recovery checkpoint from replica {src_rank} is not authenticated (no or a wrong tag): sent by a"
                " process without the cluster secret, or altered in transit; refusing it.",
                src_rank,
                "tag",
            )
        state = decode_state(blob, layout, peer=src_rank, step=step)
        if self._validate is not None:
            self._validate(state, src_rank, step)
        return state

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=self._timeout.total_seconds())
        with self._ready:
            self._served = None
            self._ready.notify_all()
