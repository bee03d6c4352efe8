"""A torchft ``CheckpointTransport`` that never unpickles: safetensors plus validated JSON over HTTP.

torchft's stock transports unpickle what a peer sends (``pickle.loads`` in the process-group transport,
``torch.load(weights_only=False)`` in the HTTP one). :class:`SafeCheckpointTransport` replaces them for our
managers: a replica asked to heal a peer encodes its state once with :func:`~lightning_hetero.ft.codec.encode_state`
(a snapshot, so later in-place updates cannot leak into what is served) and serves the bytes over HTTP; the joining
replica fetches at most the bytes its own layout allows and decodes them with
:func:`~lightning_hetero.ft.codec.decode_state`, which refuses anything off its own layout with
:class:`~lightning_hetero.comm.validation.PeerPayloadError` naming the source replica and the field.
"""

from __future__ import annotations

import logging
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

require_torchft()

from torchft.checkpointing.transport import CheckpointTransport  # noqa: E402 - after the clear ImportError

__all__ = ["SafeCheckpointTransport"]

log = logging.getLogger("lightning_hetero.ft")
_MAX_ADDRESS_CHARS = 512


class SafeCheckpointTransport(CheckpointTransport[dict[str, Any]]):
    """Serve this replica's state to joining peers and fetch a peer's state when joining, without pickle.

    Args:
        layout: Returns the receiver's own state layout (:class:`~lightning_hetero.ft.codec.StateLayout`) in the
            form the Manager hands over (``{"user": {...}, "torchft": {...}}``); called once per recovery.
        timeout: Limit of one transfer.
        host: Name peers use to reach this replica's server (default: this host's name).
        max_bytes: Upper bound of an accepted recovery blob beyond the layout's own bound (0: layout only).
    """

    def __init__(
        self,
        layout: Callable[[], StateLayout],
        *,
        timeout: timedelta = timedelta(seconds=60),
        host: str | None = None,
        max_bytes: int = 0,
    ) -> None:
        self._layout = layout
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._ready = threading.Condition()
        self._served: tuple[int, bytes] | None = None
        self.last_error: PeerPayloadError | None = None
        """The last refused recovery (the Manager only logs errors of a recovery; the replica layer re-raises it)."""
        transport = self

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                parts = self.path.strip("/").split("/")
                wanted = parts[1] if len(parts) == 2 and parts[0] == "checkpoint" else None
                # The joining replica may ask before this replica's quorum thread has encoded the step: wait for it.
                with transport._ready:
                    transport._ready.wait_for(
                        lambda: transport._served is not None and str(transport._served[0]) == wanted,
                        timeout=transport._timeout.total_seconds() if wanted is not None else 0,
                    )
                    served = transport._served
                if served is None or str(served[0]) != wanted:
                    self.send_error(404, f"no checkpoint for {self.path[:80]} (serving step {served and served[0]})")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(served[1])))
                self.end_headers()
                self.wfile.write(served[1])

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                log.debug("checkpoint server: " + format, *args)

        self._server = ThreadingHTTPServer(("", 0), _Handler)
        self._server.daemon_threads = True
        self._host = host or socket.gethostname()
        self._thread = threading.Thread(target=self._server.serve_forever, name="ft-checkpoint-server", daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        """Where peers fetch this replica's checkpoint (the step is appended)."""
        return f"http://{self._host}:{self._server.server_address[1]}/checkpoint/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta) -> None:
        """Encode ``state_dict`` now (a snapshot) and serve it for ``step`` until the next send or shutdown."""
        blob = encode_state(state_dict, step)
        with self._ready:
            self._served = (step, blob)
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
        try:
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as response:  # noqa: S310 - http only
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
        return decode_state(blob, layout, peer=src_rank, step=step)

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=self._timeout.total_seconds())
        with self._ready:
            self._served = None
            self._ready.notify_all()
