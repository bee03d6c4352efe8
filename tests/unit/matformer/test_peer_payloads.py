"""MatFormer peer bytes: setup schema hash, non-finite all-reduced buckets, DeMo buckets, gathered error feedback."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.matformer.aggregate import _check_reduced
from lightning_hetero.matformer.compressed import (
    _bucket_names,
    build_demo_replicator,
    decode_error_feedback,
    sets_without_rank0,
)
from lightning_hetero.matformer.layout import widths_for
from lightning_hetero.matformer.regions import layer_regions
from lightning_hetero.matformer.runtime import MatFormerRuntime
from lightning_hetero.matformer.schema import (
    SETUP_DOCUMENT,
    SchemaMismatchError,
    agree_on_schema,
    canonical_hash,
    module_schema,
    schema_hash,
)
from lightning_hetero.matformer.settings import MatFormerSettings
from lightning_hetero.replication.settings import ReplicationSettings
from tests.payload_rule import assert_decoder_rule

FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _document(n_layer: int = 2) -> dict:
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=16, n_layer=n_layer, n_head=2, vocab_size=32, n_positions=16))
    schema = module_schema(model)
    return {"error": None, "schema": schema, "schema_hash": canonical_hash(schema)}


def test_ranks_of_one_model_agree_on_its_schema_hash():
    document = _document()
    assert set(document) == set(SETUP_DOCUMENT)
    agreed = agree_on_schema([document, _document()])
    assert agreed == document["schema_hash"] == schema_hash(document["schema"])  # canonical_schema is idempotent


def test_a_rank_of_another_model_is_named_with_the_differing_field():
    with pytest.raises(SchemaMismatchError, match="n_layer: 3 \\(rank 1\\) != 2 \\(rank 0\\)"):
        agree_on_schema([_document(2), _document(3)])


@pytest.mark.parametrize(
    "tamper",
    [
        lambda d: d.update(schema_hash="0" * 64),  # a hash that is not the schema's
        lambda d: d["schema"].update(n_layer=9),  # a schema edited after hashing
        lambda d: d.update(schema=None),
    ],
)
def test_a_setup_document_whose_hash_does_not_match_its_schema_is_refused(tamper):
    forged = _document()
    tamper(forged)
    with pytest.raises(PeerPayloadError, match="rank 1 sent a schema hash .* that does not match the schema"):
        agree_on_schema([_document(), forged])


def test_a_non_finite_all_reduced_bucket_is_refused_or_zeroed(caplog):
    with pytest.raises(PeerPayloadError, match="bucket all-reduced over ranks \\[0, 2\\] holds non-finite"):
        _check_reduced(torch.tensor([1.0, float("inf")]), (0, 2), "raise")
    bucket = torch.tensor([1.0, float("nan"), 3.0])
    with caplog.at_level(logging.WARNING, logger="lightning_hetero.peer_payloads"):
        _check_reduced(bucket, (0, 1), "drop")
    assert bucket.tolist() == [0.0, 0.0, 0.0] and "zero gradient for those coordinates" in caplog.text
    finite = torch.tensor([1.0, -2.0])
    _check_reduced(finite, (0, 1), "raise")
    assert finite.tolist() == [1.0, -2.0]


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_a_demo_bucket_with_a_forged_member_is_refused_or_decoded_from_the_others(policy):
    replicator = build_demo_replicator(ReplicationSettings(kept_fraction=1 / 8, chunk=16, values="fp32"))
    replicator.set_bad_payload_policy(policy)
    piece = replicator.encode(0, torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))
    forged = piece.wire.clone()
    forged[-4:] = torch.tensor([0, 0, 0x80, 0x7F], dtype=torch.uint8)  # +Inf
    if policy == "raise":
        with pytest.raises(PeerPayloadError, match="replica 1 sent non-finite values"):
            replicator._decode_gathered_or_drop(piece, [piece.wire, forged])
        return
    combined = replicator._decode_gathered_or_drop(piece, [piece.wire, forged])
    assert torch.equal(combined, replicator.decode_gathered(piece, [piece.wire]))
    assert replicator.dropped_payloads == 1


@FUZZ
@given(st.binary(max_size=80), st.integers(0, 64))
def test_random_checkpoint_bucket_keys_are_refused_or_cover_the_values(data, numel):
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    try:
        names = _bucket_names(raw, 1, numel)
    except PeerPayloadError as error:
        assert "rank 1" in str(error)
        return
    assert sum(int(name.rsplit("|", 1)[1]) for name in names) == numel


def test_checkpoint_bucket_keys_that_do_not_describe_the_values_are_refused():
    def raw(text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode()), dtype=torch.uint8)

    assert _bucket_names(raw('["0,1|float32|6", "0|float32|4"]'), 1, 10) == ["0,1|float32|6", "0|float32|4"]
    for bad in ('["0,1|float32|6"]', '{"a": 1}', '["0,1|float32|-6", "x|y|16"]', '["no-bars"]', "[1"):
        with pytest.raises(PeerPayloadError, match="rank 1"):
            _bucket_names(raw(bad), 1, 10)


def test_the_settings_validate_the_policy():
    assert MatFormerRuntime(MatFormerSettings(on_bad_payload="drop")).settings.on_bad_payload == "drop"
    with pytest.raises(ValueError, match="MatFormerSettings.on_bad_payload='warn'"):
        MatFormerSettings(on_bad_payload="warn")


# ------------------------------------------------------------------------------- error-feedback gather (checkpoint)
OWN = {"0,1,2|float32|6": 6, "0,1|float32|4": 4, "0,2|float32|3": 3}  # rank 0's own buckets


def _text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def _honest() -> tuple[str, torch.Tensor]:
    return '["0,1,2|float32|6", "0,1|float32|4"]', torch.linspace(-1.0, 1.0, 10)


def test_a_ranks_error_feedback_buffers_decode_to_its_buckets():
    keys, values = _honest()
    decoded = decode_error_feedback(_text(keys), values, source=1, allowed=OWN)
    assert list(decoded) == ["0,1,2|float32|6", "0,1|float32|4"]
    assert torch.equal(torch.cat(list(decoded.values())), values)
    assert decode_error_feedback(torch.zeros(0, dtype=torch.uint8), torch.zeros(0), source=1, allowed=OWN) == {}


@pytest.mark.parametrize(
    ("keys", "values", "field"),
    [
        ('["0,1,2|float32|6", "0,1|float32|4"]', [float("nan")] + [0.0] * 9, "error_feedback.values"),
        ('["0,1,2|float32|6", "0,1|float32|4"]', [3e38] * 10, "error_feedback.values"),
        ('["0,1,2|float32|6", "0,1,2|float32|6"]', [0.0] * 12, "error_feedback.keys"),  # one bucket twice
        ('["0,2|float32|3"]', [0.0] * 3, "error_feedback.keys"),  # a bucket rank 1 is not a member of
        ('["0,1|float16|4"]', [0.0] * 4, "error_feedback.keys"),  # not one of rank 0's buckets
        ("", [0.0] * 4, "error_feedback.keys"),  # values without keys
        ('["0,1|float32|\u00b2"]', [0.0] * 2, "error_feedback.keys"),  # a unicode digit is not a size
    ],
)
def test_forged_error_feedback_is_refused_naming_the_rank_and_field(keys, values, field):
    with pytest.raises(PeerPayloadError) as caught:
        decode_error_feedback(_text(keys), torch.tensor(values), source=1, allowed=OWN)
    assert (caught.value.peer, caught.value.field) == (1, field)


def _covers_own_buckets(result: dict[str, torch.Tensor]) -> None:
    for key, value in result.items():
        assert key in OWN and "1" in key.split("|")[0].split(",") and value.numel() == OWN[key], key


@FUZZ
@given(st.binary(max_size=80), st.lists(st.floats(width=32), max_size=16))
def test_random_error_feedback_keeps_the_decoder_rule(data, values):
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    assert_decoder_rule(
        lambda: decode_error_feedback(raw, torch.tensor(values, dtype=torch.float32), source=1, allowed=OWN),
        peer=1,
        check_layout=_covers_own_buckets,
    )


@FUZZ
@given(st.sampled_from(["key byte", "value"]), st.integers(0, 200), st.integers(0, 255), st.floats(width=32))
def test_an_honest_message_with_one_corrupted_field_keeps_the_decoder_rule(field, position, byte, value):
    keys, values = _honest()
    raw = _text(keys)
    if field == "key byte":
        raw[position % raw.numel()] = byte
    else:
        values[position % values.numel()] = value
    assert_decoder_rule(
        lambda: decode_error_feedback(raw, values, source=1, allowed=OWN), peer=1, check_layout=_covers_own_buckets
    )


@pytest.mark.parametrize(("tiers", "uncovered"), [([0, 1, 2], []), ([0, 0, 1], []), ([1, 0, 0], [(1, 2)])])
def test_the_gather_bound_needs_rank0_in_every_shared_bucket(tiers, uncovered):
    member_sets = {region.members for region in layer_regions(widths_for(tiers, 16))} | {(0, 1, 2)}
    assert sets_without_rank0(member_sets) == uncovered  # rank 0 of tier 1 cannot bound the tier-0 ranks' bucket
