"""Peer bytes in comm and core: the shared error and policy, the codecs and the JSON setup documents, fuzzed."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hetero.comm import ByteLedger, payload_packing
from lightning_hetero.comm.dump import dump_ledger, load_ledger_dumps
from lightning_hetero.comm.validation import (
    PeerPayloadError,
    check_finite,
    check_index_range,
    check_length,
    validate_on_bad_payload,
)
from lightning_hetero.core.state import all_gather_json, decode_json_payload
from tests.payload_rule import assert_decoder_rule

FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
SCHEMA = {"error": (str, type(None)), "schema": (dict, type(None)), "step": int}


def test_one_error_class_for_every_strategy():
    assert issubclass(PeerPayloadError, ValueError)  # callers that caught ValueError keep working
    assert PeerPayloadError("x", peer=3).peer == 3
    assert PeerPayloadError("x", peer=3, field="values").field == "values"


@pytest.mark.parametrize("bad", ["ignore", None, 1, "Raise"])
def test_on_bad_payload_names_the_argument_and_the_choices(bad):
    with pytest.raises(ValueError, match=r"Owner\(on_bad_payload=.*'raise'.*'drop'"):
        validate_on_bad_payload("Owner", bad)
    assert validate_on_bad_payload("Owner", "drop") == "drop"


def test_the_shared_checks_name_the_peer(device):
    with pytest.raises(PeerPayloadError, match="payload from rank 2 has 3 elements, expected 4"):
        check_length(torch.zeros(3, device=device), 4, peer=2)
    with pytest.raises(PeerPayloadError, match="index 9, outside \\[0, 8\\)"):
        check_index_range(torch.tensor([1, 9], device=device), 8, peer=1)
    with pytest.raises(PeerPayloadError, match="index -1"):
        check_index_range(torch.tensor([-1, 3], device=device), 8)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(PeerPayloadError, match="non-finite"):
            check_finite(torch.tensor([0.0, bad], device=device), peer=0)
    check_finite(torch.tensor([1, 2], device=device))  # integers are never non-finite


@FUZZ
@given(st.binary(max_size=64), st.integers(0, 40), st.sampled_from(payload_packing.INDEX_BITS))
def test_random_bytes_unpack_to_indices_in_range_or_are_refused(data, count, bits):
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    try:
        indices = payload_packing.unpack_indices(raw, count, bits)
    except ValueError:
        return
    assert indices.numel() == count
    assert indices.numel() == 0 or (int(indices.min()) >= 0 and int(indices.max()) < 2**bits)


@FUZZ
@given(st.binary(max_size=96), st.integers(0, 4), st.integers(0, 8), st.sampled_from(payload_packing.VALUE_ENCODINGS))
def test_random_bytes_unpack_to_the_announced_shape_or_are_refused(data, rows, cols, encoding):
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    try:
        values = payload_packing.unpack_values(raw, rows, cols, encoding)
    except ValueError:
        return
    assert values.shape == (rows, cols) and values.dtype == torch.float32  # finiteness: the callers' check_finite


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone() if data else torch.zeros(0, dtype=torch.uint8)


@FUZZ
@given(
    st.binary(max_size=64),
    st.integers(0, 40),
    st.sampled_from(payload_packing.INDEX_BITS),
    st.integers(1, 5000),
    st.booleans(),
)
def test_random_bytes_keep_the_rule_in_the_peer_index_decoder(data, count, bits, limit, unique):
    def layout(indices: torch.Tensor) -> None:
        assert indices.shape == (count,) and indices.dtype == torch.int64
        assert count == 0 or (int(indices.min()) >= 0 and int(indices.max()) < limit)
        if unique:
            assert indices.unique().numel() == count
        assert torch.equal(payload_packing.pack_indices(indices, bits), _bytes(data))  # canonical: nothing was ignored

    assert_decoder_rule(
        lambda: payload_packing.unpack_peer_indices(
            _bytes(data), count, bits, limit=limit, rows=1 if unique else 0, peer=4
        ),
        peer=4,
        check_layout=layout,
    )


@FUZZ
@given(st.binary(max_size=96), st.integers(0, 4), st.integers(0, 8), st.sampled_from(payload_packing.VALUE_ENCODINGS))
def test_random_bytes_keep_the_rule_in_the_peer_value_decoder(data, rows, cols, encoding):
    def layout(values: torch.Tensor) -> None:
        assert values.shape == (rows, cols) and values.dtype == torch.float32

    assert_decoder_rule(
        lambda: payload_packing.unpack_peer_values(_bytes(data), rows, cols, encoding, peer=2),
        peer=2,
        check_layout=layout,
    )


@FUZZ
@given(
    st.integers(1, 4),
    st.integers(1, 9),
    st.sampled_from(payload_packing.VALUE_ENCODINGS),
    st.integers(0, 10**6),
    st.integers(0, 255),
)
def test_a_valid_value_payload_with_one_corrupted_byte_keeps_the_rule(rows, cols, encoding, position, byte):
    packed = payload_packing.pack_values(
        torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)), encoding
    )
    packed[position % packed.numel()] = byte
    decoded = assert_decoder_rule(
        lambda: payload_packing.unpack_peer_values(packed, rows, cols, encoding, peer=1), peer=1
    )
    if decoded is not None and encoding in ("sign", "ternary"):  # accepted: valid codes, a scale >= 0
        scale = packed[-4 * rows :].clone().view(torch.float32)
        assert bool((scale >= 0).all()) and bool((decoded.abs() <= scale[:, None]).all())


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_as_a_setup_document_are_refused_or_match_the_schema(data):
    try:
        document = decode_json_payload(data, 1, SCHEMA)
    except PeerPayloadError as error:
        assert "rank 1" in str(error)
        return
    assert set(document) == set(SCHEMA)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["error", "schema", "step", "extra"]),
        st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.dictionaries(st.text(), st.none())),
    )
)
def test_a_document_is_accepted_only_with_exactly_the_schema(document):
    raw = json.dumps(document).encode()
    expected = set(document) == set(SCHEMA) and all(
        isinstance(document[k], t) and not (t is int and isinstance(document[k], bool)) for k, t in SCHEMA.items()
    )
    try:
        decode_json_payload(raw, 0, SCHEMA)
        accepted = True
    except PeerPayloadError:
        accepted = False
    assert accepted == expected


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"\xff\xfe", "not JSON"),
        (b'{"error": null, "schema": null, "step": NaN}', "not JSON"),
        (b"[1, 2]", "keys list, expected"),
        (b'{"error": null, "schema": null}', "keys \\['error', 'schema'\\]"),
        (b'{"error": null, "schema": null, "step": true}', "step=True of type bool"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),  # nesting bomb: a RecursionError becomes a refusal
    ],
)
def test_malformed_setup_documents_are_refused_with_the_reason(raw, match):
    with pytest.raises(PeerPayloadError, match=match):
        decode_json_payload(raw, 1, SCHEMA)


def test_all_gather_json_checks_the_schema_on_a_single_rank_too():
    assert all_gather_json({"error": None, "schema": {}, "step": 1}, 1, torch.device("cpu"), schema=SCHEMA) == [
        {"error": None, "schema": {}, "step": 1}
    ]
    with pytest.raises(PeerPayloadError, match="rank 0 sent step='1' of type str"):
        all_gather_json({"error": None, "schema": {}, "step": "1"}, 1, torch.device("cpu"), schema=SCHEMA)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"rank": 0, "pid": 1, "tot', "is not JSON"),  # a rank killed while writing
        ('{"rank": "0", "node_rank": null, "local_rank": null, "pid": 1, "totals": {}, "steps": {}}', "'rank'"),
        ("[]", "<not an object>"),
    ],
)
def test_a_broken_ledger_dump_is_refused_naming_the_file_or_dropped(tmp_path, content, match, caplog):
    good = dump_ledger(tmp_path, ByteLedger())
    broken = tmp_path / "ledger-rank1-pid2.json"
    broken.write_text(content)
    with pytest.raises(PeerPayloadError, match=f"ledger dump .*ledger-rank1-pid2.json .*{match}"):
        load_ledger_dumps(tmp_path)
    kept = load_ledger_dumps(tmp_path, on_bad_payload="drop")
    assert [d["pid"] for d in kept] == [json.loads(good.read_text())["pid"]]
    assert "ledger dump left out" in caplog.text
