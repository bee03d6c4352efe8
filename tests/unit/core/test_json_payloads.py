"""Setup documents from peers (``core.state.decode_json_payload``): only finite, bounded numbers and unique keys pass;
everything else is a PeerPayloadError naming the rank."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError
from lightning_hetero.core.state import decode_json_payload
from tests.payload_rule import assert_decoder_rule

SCHEMA = {"tier": int, "width": float, "name": str}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"tier": 1, "width": 1e999, "name": "a"}',
        b'{"tier": 1, "width": -1e999, "name": "a"}',
        b'{"tier": 1, "width": 1e30, "name": "a"}',
        b'{"tier": 100000000000000000000000, "width": 1.0, "name": "a"}',
        b'{"tier": 1, "width": NaN, "name": "a"}',
        b'{"tier": 1, "width": Infinity, "name": "a"}',
        b'{"tier": 1, "tier": 2, "width": 1.0, "name": "a"}',
        b'{"tier": 1, "width": 1.0, "name": {"x": 1, "x": 2}}',
        b'{"tier": 1, "width": [1e999], "name": "a"}',
    ],
    ids=["inf", "-inf", "above-bound", "huge-int", "nan", "infinity", "duplicate", "nested-duplicate", "nested-inf"],
)
@pytest.mark.parametrize("schema", [SCHEMA, None], ids=["schema", "no-schema"])
def test_non_finite_unbounded_or_duplicate_is_refused_naming_the_rank(raw, schema):
    with pytest.raises(PeerPayloadError, match="rank 3") as raised:
        decode_json_payload(raw, 3, schema)
    assert raised.value.peer == 3


def test_a_valid_document_passes():
    raw = json.dumps({"tier": 2, "width": 0.5, "name": "x"}).encode()
    assert decode_json_payload(raw, 0, SCHEMA) == {"tier": 2, "width": 0.5, "name": "x"}
    bound = json.dumps({"tier": 2**64, "width": -(2.0**64), "name": "x"}).encode()
    assert decode_json_payload(bound, 0, SCHEMA)["tier"] == 2**64


def _check_numbers(value: Any) -> None:
    """Every number in an accepted document is finite and within the peer magnitude bound."""
    if isinstance(value, dict):
        for item in value.values():
            _check_numbers(item)
    elif isinstance(value, list):
        for item in value:
            _check_numbers(item)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        assert math.isfinite(value) and abs(value) <= MAX_PEER_MAGNITUDE, value


_NUMBER_TEXT = st.sampled_from(["1e999", "-1e999", "1e308", "2e19", "18446744073709551616", "NaN", "-Infinity", "0"])
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=_JSON, number=_NUMBER_TEXT, duplicate=st.booleans())
def test_fuzzed_documents_keep_the_decoder_rule(document, number, duplicate):
    text = json.dumps({"a": document, "n": 0})
    text = text.replace('"n": 0', f'"n": {number}')
    if duplicate:
        text = text[:-1] + ', "a": 1}'
    result = assert_decoder_rule(lambda: decode_json_payload(text.encode(), 2), peer=2, check_layout=_check_numbers)
    if duplicate:
        assert result is None, "a document with a duplicate key was accepted"


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64))
def test_fuzzed_bytes_keep_the_decoder_rule(raw):
    assert_decoder_rule(lambda: decode_json_payload(raw, 1, SCHEMA), peer=1, check_layout=_check_numbers)
