"""SafeCheckpointTransport: a recovery over HTTP without pickle; crafted checkpoints refused naming the peer."""

from __future__ import annotations

import pickle
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from lightning_hetero.comm.validation import PeerPayloadError

pytest.importorskip("torchft")
pytest.importorskip("safetensors")
from lightning_hetero.ft.codec import StateLayout  # noqa: E402
from lightning_hetero.ft.transport import SafeCheckpointTransport  # noqa: E402

TIMEOUT = timedelta(seconds=10)


def _state(model: torch.nn.Module, step: int = 3) -> dict:
    return {"user": {"default": {"model": model.state_dict()}}, "torchft": {"step": step, "batches_committed": step}}


@pytest.fixture
def pair():
    torch.manual_seed(0)
    sender_model, receiver_model = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    sender = SafeCheckpointTransport(lambda: StateLayout.of(_state(sender_model)), timeout=TIMEOUT, host="localhost")
    receiver = SafeCheckpointTransport(
        lambda: StateLayout.of(_state(receiver_model)), timeout=TIMEOUT, host="localhost"
    )
    yield sender_model, sender, receiver
    sender.shutdown()
    receiver.shutdown()


def _no_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a recovery unpickled peer bytes")

    for name in ("loads", "load", "Unpickler"):  # torch's streaming load unpickles through pickle.Unpickler
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


def test_a_recovery_moves_the_state_without_pickle(pair, monkeypatch):
    model, sender, receiver = pair
    _no_pickle(monkeypatch)
    before = model.weight.detach().clone()
    sender.send_checkpoint([1], 3, _state(model), TIMEOUT)
    with torch.no_grad():
        model.weight.add_(1.0)  # the live state moves on; what was sent is a snapshot of step 3
    got = receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
    assert torch.equal(got["user"]["default"]["model"]["weight"], before)
    assert got["torchft"] == {"step": 3, "batches_committed": 3}


def test_a_request_waits_for_the_step_being_encoded(pair):
    model, sender, receiver = pair
    result = {}
    fetch = threading.Thread(
        target=lambda: result.update(got=receiver.recv_checkpoint(0, sender.metadata(), 5, TIMEOUT))
    )
    fetch.start()  # the joining replica may ask before the donor's quorum thread has encoded the step
    sender.send_checkpoint([1], 5, _state(model, 5), TIMEOUT)
    fetch.join(timeout=20)
    assert result["got"]["torchft"]["step"] == 5


def test_a_checkpoint_off_the_receivers_layout_is_refused_naming_the_peer(pair):
    _, sender, receiver = pair
    sender.send_checkpoint([1], 3, _state(torch.nn.Linear(3, 4)), TIMEOUT)
    with pytest.raises(PeerPayloadError, match="recovery checkpoint from replica 4") as caught:
        receiver.recv_checkpoint(4, sender.metadata(), 3, TIMEOUT)
    assert (caught.value.peer, caught.value.field) == (4, "user/default/model/weight")
    assert receiver.last_error is caught.value


def test_a_bad_address_is_refused_as_a_peer_field(pair):
    _, _, receiver = pair
    for address in ("file:///etc/passwd#", 7, "http://" + "x" * 600):
        with pytest.raises(PeerPayloadError, match="not an http:// URL") as caught:
            receiver.recv_checkpoint(1, address, 3, TIMEOUT)  # type: ignore[arg-type]
        assert (caught.value.peer, caught.value.field) == (1, "metadata")


def test_an_oversized_announcement_is_refused_before_reading():
    served = []

    class Huge(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            served.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 40))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("localhost", 0), Huge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    receiver = SafeCheckpointTransport(lambda: StateLayout.of(_state(torch.nn.Linear(3, 2))), timeout=TIMEOUT)
    try:
        with pytest.raises(PeerPayloadError, match="before allocating") as caught:
            receiver.recv_checkpoint(2, f"http://localhost:{server.server_address[1]}/checkpoint/", 3, TIMEOUT)
        assert caught.value.peer == 2 and served == ["/checkpoint/3"]
    finally:
        receiver.shutdown()
        server.shutdown()
        server.server_close()


def test_a_wrong_step_is_a_connection_failure_not_a_payload_fault(pair):
    model, sender, receiver = pair
    sender.send_checkpoint([1], 3, _state(model), TIMEOUT)
    quick = timedelta(seconds=1)
    short = SafeCheckpointTransport(lambda: StateLayout.of(_state(model)), timeout=quick, host="localhost")
    short.send_checkpoint([1], 3, _state(model), quick)
    try:
        with pytest.raises(ConnectionError, match="404"):
            receiver.recv_checkpoint(0, short.metadata(), 4, TIMEOUT)
    finally:
        short.shutdown()
