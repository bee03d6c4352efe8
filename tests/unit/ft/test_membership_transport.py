"""The recovery server answers authenticated members only; a stranger gets the same empty 404 for everything, and a
forged or altered blob is refused before it is decoded (and not kept as the replica's fatal error)."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from lightning_hetero.ft.membership import ClusterSecret

pytest.importorskip("torchft")
pytest.importorskip("safetensors")
from lightning_hetero.ft.codec import StateLayout, encode_state  # noqa: E402
from lightning_hetero.ft.transport import SafeCheckpointTransport, UnauthenticatedPeerError  # noqa: E402

TIMEOUT = timedelta(seconds=10)
SECRET = ClusterSecret(b"s" * 32, "test")


def _state(model: torch.nn.Module, step: int = 3) -> dict:
    return {"user": {"default": {"model": model.state_dict()}}, "torchft": {"step": step, "batches_committed": step}}


def _transport(model: torch.nn.Module, secret: ClusterSecret | None = SECRET, **kwargs) -> SafeCheckpointTransport:
    return SafeCheckpointTransport(
        lambda: StateLayout.of(_state(model)), timeout=TIMEOUT, host="localhost", secret=secret, **kwargs
    )


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _answer(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, bytes, list[str]]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), sorted(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), sorted(k for k in error.headers if k.lower().startswith("x-"))


def test_a_member_heals_and_a_stranger_gets_the_same_empty_404_for_everything(model):
    sender, member = _transport(model), _transport(model)
    stranger = _transport(model, ClusterSecret(b"t" * 32, "stranger"))
    try:
        sender.send_checkpoint([1], 3, _state(model), TIMEOUT)
        got = member.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
        assert torch.equal(got["user"]["default"]["model"]["weight"], model.weight)
        with pytest.raises(ConnectionError, match="404"):
            stranger.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)  # a token under another secret
        url = sender.metadata()
        nonce = "ab" * 16
        token = SECRET.request_token("", 3, nonce)
        assert _answer(f"{url}3", {"X-LH-Nonce": nonce, "X-LH-Token": token})[0] == 200
        answers = [
            _answer(f"{url}3"),  # no token
            _answer(f"{url}3", {"X-LH-Nonce": "cd" * 16, "X-LH-Token": "0" * 64}),  # a forged one
            _answer(f"{url}3", {"X-LH-Nonce": nonce, "X-LH-Token": token}),  # a replayed request
            _answer(f"{url}4", {"X-LH-Nonce": nonce, "X-LH-Token": token}),  # another step
            _answer(f"{url}../../etc/passwd"),
            _answer(f"{url}3", method="POST"),
            _answer(f"{url}3", method="DELETE"),
        ]
        assert answers == [(404, b"", [])] * len(answers)  # nothing revealed, not even the step served
        assert sender.refused_requests >= 6
    finally:
        for transport in (sender, member, stranger):
            transport.shutdown()


def _serve(blob: bytes, tag: str | None) -> ThreadingHTTPServer:
    class Forger(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(blob)))
            if tag is not None:
                self.send_header("X-LH-Tag", tag)
            self.end_headers()
            self.wfile.write(blob)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("localhost", 0), Forger)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("tag", [None, "0" * 64, "flipped"])
def test_a_forged_or_altered_blob_is_refused_before_decoding_and_is_not_fatal(model, tag):
    receiver = _transport(model)
    with torch.no_grad():
        forged = torch.nn.Linear(3, 2)
        forged.weight.fill_(1e4)
    blob = encode_state(_state(forged), 3)
    if tag == "flipped":  # a member's genuine tag, one bit of the blob flipped on the wire
        tag = "valid-for-the-original"
        blob = bytearray(blob)
        blob[-1] ^= 0x80
        blob = bytes(blob)
    server = _serve(blob, tag)
    try:
        with pytest.raises(UnauthenticatedPeerError, match="not authenticated") as caught:
            receiver.recv_checkpoint(5, f"http://localhost:{server.server_address[1]}/checkpoint/", 3, TIMEOUT)
        assert (caught.value.peer, caught.value.field) == (5, "tag")
        assert receiver.last_error is None and receiver.refused_heals == 1  # the replica goes on, not raised
    finally:
        receiver.shutdown()
        server.shutdown()
        server.server_close()


def test_a_blob_of_another_cluster_is_refused(model):
    sender = _transport(model, cluster="run-a")
    receiver = _transport(model, cluster="run-b")
    try:
        sender.send_checkpoint([1], 3, _state(model), TIMEOUT)
        with pytest.raises((UnauthenticatedPeerError, ConnectionError)):
            receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_the_server_binds_where_it_is_told(model):
    transport = _transport(model, bind="127.0.0.1")
    try:
        assert transport._server.server_address[0] == "127.0.0.1"
    finally:
        transport.shutdown()
