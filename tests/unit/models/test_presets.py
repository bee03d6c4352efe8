"""Presets: every family and size builds, with the advertised parameter counts."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, LlamaConfig, T5Config, ViTConfig

from lightning_hetero.models import PRESETS, build_config
from lightning_hetero.models.presets import count_parameters

# Advertised ranges (docs/models.md): tiny ~1M, small ~10-20M, medium ~30M parameters.
PARAMETER_RANGES = {"tiny": (0.5e6, 2e6), "small": (8e6, 25e6), "medium": (25e6, 40e6)}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_parameter_count_in_advertised_range(preset: str) -> None:
    low, high = PARAMETER_RANGES[preset.rsplit("-", 1)[1]]
    assert low <= count_parameters(preset) <= high


def test_every_family_has_tiny_and_small() -> None:
    for family in ("llama", "gpt2", "t5", "vit", "bert"):
        assert {f"{family}-tiny", f"{family}-small"} <= set(PRESETS)


def test_build_config_returns_family_config_class() -> None:
    assert isinstance(build_config("llama-tiny"), LlamaConfig)
    assert isinstance(build_config("gpt2-small"), GPT2Config)
    assert isinstance(build_config("t5-tiny"), T5Config)
    assert isinstance(build_config("vit-small"), ViTConfig)


def test_llama_presets_use_gqa_and_untied_embeddings() -> None:
    for preset in ("llama-tiny", "llama-small"):
        config = build_config(preset)
        assert config.num_key_value_heads < config.num_attention_heads
        assert config.tie_word_embeddings is False


def test_overrides_replace_preset_values_and_leave_the_registry_untouched() -> None:
    config = build_config("llama-tiny", {"vocab_size": 4096, "hidden_size": 64})
    assert (config.vocab_size, config.hidden_size) == (4096, 64)
    assert PRESETS["llama-tiny"]["vocab_size"] == 2048
    assert count_parameters("llama-tiny", {"vocab_size": 4096}) > count_parameters("llama-tiny")


def test_unknown_preset_lists_available_ones() -> None:
    with pytest.raises(ValueError, match="Available presets: .*llama-tiny"):
        build_config("llama-huge")


def test_contradicting_model_type_raises() -> None:
    with pytest.raises(ValueError, match="contradicts preset"):
        build_config("llama-tiny", {"model_type": "gpt2"})


def test_misspelt_key_raises_with_suggestion() -> None:
    with pytest.raises(ValueError, match="did you mean hidden_size"):
        build_config("llama-tiny", {"hidden_szie": 64})


def test_unrelated_unknown_key_only_warns() -> None:
    # HF still accepts legacy aliases (e.g. rope_theta); an unknown key far from any field passes with a warning.
    with pytest.warns(UserWarning, match="not a known field"):
        config = build_config("llama-tiny", {"rope_theta": 5000.0})
    assert config.rope_parameters["rope_theta"] == 5000.0
