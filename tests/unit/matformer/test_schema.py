"""Schema identity: tiers of one model hash alike; a real difference is named with ranks, fields and values."""

from __future__ import annotations

import copy

import pytest
import transformers as tf

from lightning_hetero.matformer.export import export_tier
from lightning_hetero.matformer.schema import SchemaMismatchError, canonical_schema, compare_schemas, schema_hash
from lightning_hetero.matformer.slicing import slice_model
from tests.unit.matformer._tiny_hf import FAMILIES


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hash_is_equal_across_tiers(name: str) -> None:
    full = FAMILIES[name].build()
    reference = schema_hash(full.config)
    for tier in (1, 2):
        sliced = slice_model(copy.deepcopy(full), tier)
        assert sliced.config.to_dict() != full.config.to_dict()  # the size field really changed
        assert schema_hash(sliced.config) == reference


def test_hash_of_an_exported_tier_checkpoint_equals_the_full_model(tmp_path) -> None:
    full = FAMILIES["gpt2"].build()
    export_tier(full, 2, tmp_path)
    loaded_config = tf.AutoConfig.from_pretrained(tmp_path)
    assert loaded_config.n_inner == 8
    assert schema_hash(loaded_config) == schema_hash(full.config)


def test_gpt2_n_inner_none_means_four_times_n_embd() -> None:
    implicit = tf.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_inner=None)
    explicit = tf.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_inner=64)
    assert canonical_schema(implicit)["n_inner"] == 64
    assert schema_hash(implicit) == schema_hash(explicit)


def test_per_rank_fields_are_ignored_and_real_fields_are_not() -> None:
    config = FAMILIES["llama"].make_config(32)
    other = copy.deepcopy(config)
    other.dtype = "bfloat16"
    other._name_or_path = "/somewhere/else"
    other.architectures = ["LlamaModel"]
    other.use_cache = False
    assert schema_hash(other) == schema_hash(config)
    other.num_hidden_layers = 3
    assert schema_hash(other) != schema_hash(config)
    bigger = FAMILIES["llama"].make_config(64)  # a genuinely wider FFN is another model
    assert schema_hash(bigger) != schema_hash(config)
    other.num_hidden_layers = 2
    other.rms_norm_eps = 1e-5
    assert schema_hash(other) != schema_hash(config)
    assert schema_hash(other, ignore_fields=["rms_norm_eps"]) == schema_hash(config, ignore_fields=["rms_norm_eps"])


def test_canonical_schema_accepts_a_dict_and_is_sorted() -> None:
    config = FAMILIES["t5-gated"].make_config(32)
    schema = canonical_schema(config.to_dict())
    assert schema == canonical_schema(config)
    assert list(schema) == sorted(schema)
    assert "transformers_version" not in schema and schema["d_ff"] == 32


def test_compare_schemas_passes_for_tiers_and_names_ranks_and_fields() -> None:
    full = FAMILIES["llama"].build()
    tier1 = slice_model(copy.deepcopy(full), 1)
    compare_schemas({0: canonical_schema(full.config), 1: canonical_schema(tier1.config)})
    odd = copy.deepcopy(full.config)
    odd.hidden_size = 24
    odd.vocab_size = 100
    schemas = {
        0: canonical_schema(full.config),
        1: canonical_schema(tier1.config),
        2: canonical_schema(odd),
        3: canonical_schema(full.config),
    }
    with pytest.raises(SchemaMismatchError) as info:
        compare_schemas(schemas)
    message = str(info.value)
    assert "rank(s) 2 differs from rank 0" in message
    assert "hidden_size: 24 (rank 2) != 16 (rank 0)" in message
    assert "vocab_size: 100 (rank 2) != 64 (rank 0)" in message
    assert "rank 1:" not in message and "rank 3:" not in message
    assert info.value.reference_rank == 0
    assert info.value.differences == {2: {"hidden_size": (24, 16), "vocab_size": (100, 64)}}


def test_compare_schemas_nested_and_missing_fields() -> None:
    with pytest.raises(SchemaMismatchError, match=r"rope_parameters.rope_theta: 500000.0 \(rank 5\) != 10000.0"):
        compare_schemas({5: {"rope_parameters": {"rope_theta": 500000.0}}, 4: {"rope_parameters": {"rope_theta": 1e4}}})
    with pytest.raises(SchemaMismatchError, match=r"extra: 1 \(rank 1\) != '<missing>' \(rank 0\)"):
        compare_schemas({0: {}, 1: {"extra": 1}})
    with pytest.raises(ValueError, match="schemas_by_rank is empty"):
        compare_schemas({})
