"""Named Hugging Face model configurations, small enough to train on a laptop CPU.

A preset is ``"<family>-<size>"`` (``"llama-tiny"``, ``"gpt2-small"``, ``"t5-tiny"``, ``"vit-small"``, ...) and maps to
the keyword arguments of the family's ``transformers`` config class. ``tiny`` is ~1M parameters (text: 2,048-token
vocabulary; images: 28x28, 1 channel, 10 classes) for unit tests and smoke runs; ``small`` is ~10-20M parameters
(text: 8,192-token vocabulary) for short real training runs; ``llama-medium`` (~30M) is the link-bound benchmark size.

Conventions shared by every text preset, so that a tokenizer trained by our datamodules fits without overrides:
``pad_token_id=0``, ``bos_token_id=1``, ``eos_token_id=2`` (T5 has no BOS and starts decoding from the pad token).
Datamodules override these (and ``vocab_size``) through ``hf_config_overrides()``; see ``docs/models.md``.

Print the table of presets with their parameter counts::

    python -m lightning_hetero.models
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig

# Shared token-id convention (see module docstring).
_TEXT_TOKEN_IDS: dict[str, int] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

#: Config keyword arguments per preset name ``"<family>-<size>"``; ``model_type`` selects the config class.
PRESETS: dict[str, dict[str, Any]] = {
    # Llama: grouped-query attention (KV heads < query heads) as in SmolLM2/Llama-3, and untied embeddings
    # (HF's Llama default is also False): the input embedding and the LM head are separate weights, so a pipeline
    # can place them on different stages and MatFormer/subspace methods can treat them independently.
    "llama-tiny": {
        "model_type": "llama",
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 320,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        **_TEXT_TOKEN_IDS,
    },
    "llama-small": {
        "model_type": "llama",
        "vocab_size": 8192,
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        **_TEXT_TOKEN_IDS,
    },
    # ~26M parameters with the 2,048-token Shakespeare tokenizer (~31M at its own 8,192 vocabulary): big enough that
    # a full-gradient all-reduce over a 20-100 Mbit link takes 10-100x one CPU core's step (the regime of
    # docs/benchmarks.md#operating-point), small enough for a few hundred steps on 2 cores.
    "llama-medium": {
        "model_type": "llama",
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        **_TEXT_TOKEN_IDS,
    },
    # GPT-2 keeps its canonical tied embeddings (wte is also the LM head).
    "gpt2-tiny": {
        "model_type": "gpt2",
        "vocab_size": 2048,
        "n_embd": 128,
        "n_layer": 4,
        "n_head": 4,
        "n_positions": 512,
        **_TEXT_TOKEN_IDS,
    },
    "gpt2-small": {
        "model_type": "gpt2",
        "vocab_size": 8192,
        "n_embd": 384,
        "n_layer": 6,
        "n_head": 6,
        "n_positions": 1024,
        **_TEXT_TOKEN_IDS,
    },
    # T5 (v1.0 layout: ReLU FFN, tied embeddings). transformers 5 no longer defaults decoder_start_token_id, and
    # the model cannot shift labels without it, so every T5 preset sets it (to the pad token, as T5 does).
    "t5-tiny": {
        "model_type": "t5",
        "vocab_size": 2048,
        "d_model": 128,
        "d_kv": 32,
        "num_heads": 4,
        "d_ff": 512,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "pad_token_id": 0,
        "eos_token_id": 2,
        "decoder_start_token_id": 0,
    },
    "t5-small": {
        "model_type": "t5",
        "vocab_size": 8192,
        "d_model": 384,
        "d_kv": 64,
        "num_heads": 6,
        "d_ff": 1536,
        "num_layers": 4,
        "num_decoder_layers": 4,
        "pad_token_id": 0,
        "eos_token_id": 2,
        "decoder_start_token_id": 0,
    },
    # ViT on 28x28 grey images (MNIST-like), 4x4 patches -> 49 patches + [CLS].
    "vit-tiny": {
        "model_type": "vit",
        "image_size": 28,
        "patch_size": 4,
        "num_channels": 1,
        "num_labels": 10,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 512,
    },
    "vit-small": {
        "model_type": "vit",
        "image_size": 28,
        "patch_size": 4,
        "num_channels": 1,
        "num_labels": 10,
        "hidden_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "intermediate_size": 1536,
    },
    # BERT (no reference module here; useful for masked-LM experiments and adapter tests).
    "bert-tiny": {
        "model_type": "bert",
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 512,
        "max_position_embeddings": 512,
        "pad_token_id": 0,
    },
    "bert-small": {
        "model_type": "bert",
        "vocab_size": 8192,
        "hidden_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "intermediate_size": 1536,
        "max_position_embeddings": 512,
        "pad_token_id": 0,
    },
}

#: The ``transformers`` auto class whose head each family's presets are sized for (used to count parameters).
FAMILY_AUTO_CLASS: dict[str, str] = {
    "llama": "AutoModelForCausalLM",
    "gpt2": "AutoModelForCausalLM",
    "t5": "AutoModelForSeq2SeqLM",
    "vit": "AutoModelForImageClassification",
    "bert": "AutoModelForMaskedLM",
}

# Keys every config accepts although they are not dataclass fields of every config class.
_GENERIC_CONFIG_KEYS = frozenset(
    {
        "num_labels",
        "id2label",
        "label2id",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tie_word_embeddings",
        "attn_implementation",
        "dtype",
        "problem_type",
    }
)


def preset_model_type(preset: str) -> str:
    """Return the HF ``model_type`` of a preset (e.g. ``"llama"`` for ``"llama-tiny"``).

    Raises:
        ValueError: unknown preset; the message lists the available ones.
    """
    if preset not in PRESETS:
        raise ValueError(
            f"Unknown preset {preset!r}. Available presets: {', '.join(sorted(PRESETS))}. "
            f"Or pass preset=None with a full `config` that contains `model_type`."
        )
    return PRESETS[preset]["model_type"]


def check_config_keys(model_type: str, keys: Any) -> None:
    """Catch misspelt config keys before they silently become unused attributes.

    HF configs accept any keyword and store unknown ones as plain attributes, so ``hidden_szie=256`` would be
    ignored without a word. A key that is not a known field but is close to one raises; a key that is neither
    known nor close to a known one only warns (HF still accepts legacy aliases such as ``rope_theta``).

    Raises:
        ValueError: a key looks like a misspelling of a known field.
    """
    config_class = AutoConfig.for_model(model_type).__class__
    known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {})) | _GENERIC_CONFIG_KEYS
    for key in keys:
        if key in known or key == "model_type":
            continue
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.8)
        if close:
            raise ValueError(
                f"Config key {key!r} is not a field of {config_class.__name__}; did you mean {' or '.join(close)}?"
            )
        warnings.warn(
            f"Config key {key!r} is not a known field of {config_class.__name__}; it is passed through unchanged.",
            UserWarning,
            stacklevel=3,
        )


def build_config(preset: str, overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    """Build the HF config of a preset, with optional keyword overrides.

    Args:
        preset: Preset name ``"<family>-<size>"``, one of :data:`PRESETS`.
        overrides: Config keywords that replace the preset's values (e.g. ``{"vocab_size": 4096}``). A
            ``model_type`` in it must equal the preset's.

    Returns:
        The config, e.g. a ``LlamaConfig`` for ``"llama-tiny"``.

    Raises:
        ValueError: unknown preset, a ``model_type`` that contradicts the preset, or a misspelt key.
    """
    model_type = preset_model_type(preset)
    overrides = dict(overrides or {})
    override_type = overrides.pop("model_type", model_type)
    if override_type != model_type:
        raise ValueError(
            f"overrides['model_type']={override_type!r} contradicts preset {preset!r} (model_type {model_type!r}). "
            f"Pick a {override_type} preset or drop model_type from the overrides."
        )
    check_config_keys(model_type, overrides)
    kwargs = {key: value for key, value in PRESETS[preset].items() if key != "model_type"}
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def count_parameters(preset: str, overrides: dict[str, Any] | None = None) -> int:
    """Number of parameters of a preset's model with its family's head (see :data:`FAMILY_AUTO_CLASS`).

    Tied weights count once.
    """
    config = build_config(preset, overrides)
    auto_class = getattr(transformers, FAMILY_AUTO_CLASS[config.model_type])
    # The meta device makes counting free: no memory, no initialisation.
    with torch.device("meta"):
        model = auto_class.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


def print_presets() -> None:
    """Print every preset with its model class and parameter count (``python -m lightning_hetero.models``)."""
    print(f"| {'preset':<12} | {'model class':<28} | {'params':>8} |")
    print(f"|{'-' * 14}|{'-' * 30}|{'-' * 9}:|")
    for name in PRESETS:
        config = build_config(name)
        model_class = getattr(transformers, FAMILY_AUTO_CLASS[config.model_type])._model_mapping[type(config)]
        print(f"| {name:<12} | {model_class.__name__:<28} | {count_parameters(name) / 1e6:>7.2f}M |")
