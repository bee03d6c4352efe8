"""The pickle-free recovery checkpoint codec: a round trip is exact, and every crafted blob is refused by name."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.ft.codec import FORMAT, SKELETON_KEY, STEP_KEY, StateLayout, blob_limit, decode_state
from tests.payload_rule import assert_decoder_rule

pytest.importorskip("safetensors")
from lightning_hetero.ft.codec import encode_state  # noqa: E402 - needs safetensors

PEER = 2
SLOTS = ("user", "default", "optimizer", "state")


def _replica(seed: int, trained: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    if trained:
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
    return model, optimizer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int = 7) -> dict:
    return {
        "user": {
            "default": {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            }
        },
        "torchft": {"step": step, "batches_committed": 2 * step},
    }


def _layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StateLayout:
    shapes = {i: tuple(p.shape) for i, p in enumerate(model.parameters())}
    return StateLayout.of(_state(model, optimizer, 0), {SLOTS: shapes})


@pytest.fixture(scope="module")
def sent() -> tuple[dict, bytes]:
    state = _state(*_replica(0, trained=True))
    return state, encode_state(state, 7)


@pytest.fixture(scope="module")
def layout() -> StateLayout:
    return _layout(*_replica(1, trained=False))  # a fresh joiner: no optimizer state yet


def _parts(blob: bytes) -> tuple[dict, bytes]:
    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + size]), blob[8 + size :]


def _blob(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _with_skeleton(blob: bytes, edit) -> bytes:
    header, body = _parts(blob)
    skeleton = json.loads(header["__metadata__"][SKELETON_KEY])
    edit(skeleton)
    header["__metadata__"][SKELETON_KEY] = json.dumps(skeleton)
    return _blob(header, body)


def _entry(node: dict, *keys):
    for key in keys:
        node = dict((k, v) for k, v in node["d"])[key]
    return node


def test_round_trip_heals_a_fresh_replica_bit_for_bit(sent, layout):
    state, blob = sent
    model, optimizer = _replica(1, trained=False)
    got = decode_state(blob, layout, peer=PEER, step=7)
    model.load_state_dict(got["user"]["default"]["model"])
    optimizer.load_state_dict(got["user"]["default"]["optimizer"])
    source = state["user"]["default"]
    for mine, theirs in zip(model.state_dict().values(), source["model"].values(), strict=True):
        assert torch.equal(mine, theirs)
    for key, entry in source["optimizer"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(optimizer.state_dict()["state"][key][name], value)
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)  # tuples stay tuples
    assert got["user"]["default"]["rng"]["python"] == source["rng"]["python"]
    assert got["torchft"] == {"step": 7, "batches_committed": 14}


def test_encode_refuses_what_json_and_safetensors_cannot_carry():
    with pytest.raises(TypeError, match="convert it in the state_dict function"):
        encode_state({"x": object()}, 0)
    with pytest.raises(ValueError, match="finite"):
        encode_state({"lr": float("nan")}, 0)


@pytest.mark.parametrize(
    ("name", "edit", "field"),
    [
        ("extra key", lambda s: _entry(s, "user")["d"].append(["evil", 1]), "user"),
        ("missing key", lambda s: _entry(s, "torchft")["d"].pop(), "torchft"),
        ("int became str", lambda s: _entry(s, "torchft")["d"][0].__setitem__(1, "7"), "torchft/step"),
        ("huge int", lambda s: _entry(s, "torchft")["d"][1].__setitem__(1, 2**70), "torchft/batches_committed"),
        (
            "param group key added",
            lambda s: _entry(s, "user", "default", "optimizer", "param_groups")["l"][0]["d"].append(["x", 1]),
            "user/default/optimizer/param_groups/0",
        ),
        ("state for an unknown parameter", lambda s: _entry(s, *SLOTS)["d"][0].__setitem__(0, 99), "/".join(SLOTS)),
    ],
)
def test_a_crafted_skeleton_is_refused_naming_peer_and_field(sent, layout, name, edit, field):
    blob = _with_skeleton(sent[1], edit)
    with pytest.raises(PeerPayloadError) as caught:
        decode_state(blob, layout, peer=PEER, step=7)
    assert caught.value.peer == PEER, name
    assert caught.value.field == field, (name, str(caught.value))
    assert "replica 2" in str(caught.value) and "refusing" in str(caught.value)


def _retensor(blob: bytes, name: str, **changes) -> bytes:
    header, body = _parts(blob)
    header[name].update(changes)
    return _blob(header, body)


def test_a_tensor_off_the_receivers_layout_is_refused_before_allocation(sent, layout):
    weight = "user/default/model/0.weight"
    for changes, words in [
        ({"shape": [4, 3]}, "F32 [4, 3], this replica holds F32 [3, 4]"),
        ({"dtype": "F64"}, "this replica holds F32 [3, 4]"),
        ({"shape": [1 << 40, 1 << 20]}, "this replica holds"),
        ({"data_offsets": [0, 10]}, "data offsets"),
    ]:
        with pytest.raises(PeerPayloadError, match="replica 2") as caught:
            decode_state(_retensor(sent[1], weight, **changes), layout, peer=PEER, step=7)
        assert caught.value.field == weight and words in str(caught.value), str(caught.value)


def test_non_finite_or_huge_weights_are_refused(layout):
    model, optimizer = _replica(0, trained=True)
    for bad in (float("nan"), float("inf"), 2.0**70):
        with torch.no_grad():
            model[0].weight[0, 0] = bad
        with pytest.raises(PeerPayloadError) as caught:
            decode_state(encode_state(_state(model, optimizer), 7), layout, peer=PEER, step=7)
        assert (caught.value.peer, caught.value.field) == (PEER, "user/default/model/0.weight")


def test_sizes_step_and_format_are_checked(sent, layout):
    blob = sent[1]
    with pytest.raises(PeerPayloadError, match="step 7, asked for step 8") as caught:
        decode_state(blob, layout, peer=PEER, step=8)
    assert caught.value.field == "step"
    header, body = _parts(blob)
    header["__metadata__"]["format"] = "other/9"
    with pytest.raises(PeerPayloadError, match="format") as caught:
        decode_state(_blob(header, body), layout, peer=PEER, step=7)
    huge_header = struct.pack("<Q", 1 << 62) + blob[8:]
    with pytest.raises(PeerPayloadError, match="before allocating") as caught:
        decode_state(huge_header, layout, peer=PEER, step=7)
    assert caught.value.field == "header size"
    too_long = blob + bytes(blob_limit(layout))
    with pytest.raises(PeerPayloadError, match="before allocating") as caught:
        decode_state(too_long, layout, peer=PEER, step=7)
    assert caught.value.field == "recovery checkpoint size"


def test_unused_and_overlapping_tensors_are_refused(sent, layout):
    header, body = _parts(sent[1])
    header["stowaway"] = {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}
    with pytest.raises(PeerPayloadError, match="never uses"):
        decode_state(_blob(header, body), layout, peer=PEER, step=7)
    header, body = _parts(sent[1])
    first, second = "user/default/model/0.bias", "user/default/model/1.bias"
    header[second]["data_offsets"] = [header[first]["data_offsets"][0], header[first]["data_offsets"][0] + 8]
    with pytest.raises(PeerPayloadError, match="share bytes"):
        decode_state(_blob(header, body), layout, peer=PEER, step=7)


def _check_layout(expected: StateLayout):
    def check(result):
        model = result["user"]["default"]["model"]
        for name, tensor in model.items():
            dtype, shape = expected.tensors[f"user/default/model/{name}"]
            assert tensor.dtype == dtype and tuple(tensor.shape) == shape

    return check


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_every_mutated_blob_is_decoded_within_the_rule_or_refused(sent, layout, data):
    blob = bytearray(sent[1])
    how = data.draw(st.sampled_from(["flip", "truncate", "splice", "random"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    elif how == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    elif how == "splice":
        at = data.draw(st.integers(0, len(blob)))
        blob[at:at] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        blob = bytearray(data.draw(st.binary(max_size=256)))
    assert_decoder_rule(
        lambda: decode_state(bytes(blob), layout, peer=PEER, step=7), peer=PEER, check_layout=_check_layout(layout)
    )


def test_the_format_constants_are_in_the_blob(sent):
    header, _ = _parts(sent[1])
    assert header["__metadata__"]["format"] == FORMAT and header["__metadata__"][STEP_KEY] == "7"


def test_lazily_created_per_parameter_tensors_must_have_the_parameters_shape():
    """DiLoCo's anchors appear at the first sync: a fresh receiver has none, a peer's must match the parameters."""
    anchors = ("user", "default", "optimizer", "replicator", "anchors")

    def state(values: dict) -> dict:
        replicator = {"name": "diloco", "step": 4, "anchors": values}
        return {"user": {"default": {"optimizer": {"replicator": replicator}}}, "torchft": {"step": 4}}

    layout = StateLayout.of(state({}), {anchors: {0: (3, 2), 1: (2,)}})
    good = {0: torch.ones(3, 2), 1: torch.zeros(2)}
    got = decode_state(encode_state(state(good), 4), layout, peer=PEER, step=4)
    assert torch.equal(got["user"]["default"]["optimizer"]["replicator"]["anchors"][0], good[0])
    for bad, field in [({0: torch.ones(2, 3)}, "/".join(anchors) + "/0"), ({5: torch.ones(2)}, "/".join(anchors))]:
        with pytest.raises(PeerPayloadError) as caught:
            decode_state(encode_state(state(bad), 4), layout, peer=PEER, step=4)
        assert (caught.value.peer, caught.value.field) == (PEER, field), str(caught.value)
