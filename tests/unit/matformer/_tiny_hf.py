"""Tiny random HF models of every MatFormer adapter family, in float64, with inputs and a dense tier reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers as tf
from torch import nn

from lightning_hetero.matformer.adapters import ffn_parameters

VOCAB = 64
D = 16
H = 32  # FFN size: tiers 0, 1, 2 -> 32, 16, 8
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": D,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    **TOKENS,
}


@dataclass(frozen=True)
class Family:
    """How to build, feed and size one family's tiny model."""

    name: str
    make_config: Callable[[int], tf.PretrainedConfig]
    """FFN size -> config."""
    auto_class: Any
    """The auto class that loads the exported checkpoint."""
    model_class: Any
    inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]
    n_inputs_per_ffn: int
    """Input projections per FFN (1 plain, 2 gated)."""
    input_bias: bool
    output_bias: bool

    def build(self, size: int = H, seed: int = 0) -> nn.Module:
        """A float64 model in eval mode with random weights (biases randomized too, so bias slicing is exercised)."""
        torch.manual_seed(seed)
        model = self.model_class(self.make_config(size)).to(torch.float64).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.1)
        return model


def _text_ids(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(3, VOCAB, (2, 7), generator=gen)}


def _t5_ids(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(3, VOCAB, (2, 7), generator=gen),
        "decoder_input_ids": torch.randint(3, VOCAB, (2, 5), generator=gen),
    }


def _pixels(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(2, 3, 8, 8, generator=gen, dtype=torch.float64)}


def _t5_config(gated: bool) -> Callable[[int], tf.PretrainedConfig]:
    return lambda h: tf.T5Config(
        vocab_size=VOCAB,
        d_model=D,
        d_kv=8,
        d_ff=h,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        feed_forward_proj="gated-gelu" if gated else "relu",
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )


FAMILIES: dict[str, Family] = {
    "llama": Family(
        "llama",
        lambda h: tf.LlamaConfig(intermediate_size=h, mlp_bias=True, **_DECODER),
        tf.AutoModelForCausalLM,
        tf.LlamaForCausalLM,
        _text_ids,
        2,
        True,
        True,
    ),
    "mistral": Family(
        "mistral",
        lambda h: tf.MistralConfig(intermediate_size=h, **_DECODER),
        tf.AutoModelForCausalLM,
        tf.MistralForCausalLM,
        _text_ids,
        2,
        False,
        False,
    ),
    "qwen2": Family(
        "qwen2",
        lambda h: tf.Qwen2Config(intermediate_size=h, **_DECODER),
        tf.AutoModelForCausalLM,
        tf.Qwen2ForCausalLM,
        _text_ids,
        2,
        False,
        False,
    ),
    "qwen3": Family(
        "qwen3",
        lambda h: tf.Qwen3Config(intermediate_size=h, head_dim=8, **_DECODER),
        tf.AutoModelForCausalLM,
        tf.Qwen3ForCausalLM,
        _text_ids,
        2,
        False,
        False,
    ),
    "olmo2": Family(
        "olmo2",
        lambda h: tf.Olmo2Config(intermediate_size=h, **_DECODER),
        tf.AutoModelForCausalLM,
        tf.Olmo2ForCausalLM,
        _text_ids,
        2,
        False,
        False,
    ),
    "gpt2": Family(
        "gpt2",
        lambda h: tf.GPT2Config(vocab_size=VOCAB, n_embd=D, n_layer=2, n_head=2, n_positions=32, n_inner=h, **TOKENS),
        tf.AutoModelForCausalLM,
        tf.GPT2LMHeadModel,
        _text_ids,
        1,
        True,
        True,
    ),
    "t5": Family(
        "t5", _t5_config(False), tf.AutoModelForSeq2SeqLM, tf.T5ForConditionalGeneration, _t5_ids, 1, False, False
    ),
    "t5-gated": Family(
        "t5-gated", _t5_config(True), tf.AutoModelForSeq2SeqLM, tf.T5ForConditionalGeneration, _t5_ids, 2, False, False
    ),
    "vit": Family(
        "vit",
        lambda h: tf.ViTConfig(
            hidden_size=D,
            intermediate_size=h,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
            num_labels=3,
        ),
        tf.AutoModelForImageClassification,
        tf.ViTForImageClassification,
        _pixels,
        1,
        True,
        True,
    ),
    "bert": Family(
        "bert",
        lambda h: tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=D,
            intermediate_size=h,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
            pad_token_id=0,
        ),
        tf.AutoModel,
        tf.BertModel,
        _text_ids,
        1,
        True,
        True,
    ),
}


def n_ffns(model: nn.Module) -> int:
    """Number of FFNs in a tiny model (T5: encoder + decoder)."""
    return len({p.layer for p in ffn_parameters(model)})


def dense_reference(family: Family, full: nn.Module, width: int) -> nn.Module:
    """A dense model built with FFN size ``width`` whose weights are the prefix of ``full`` (independent of slicing)."""
    dense = family.model_class(family.make_config(width)).to(torch.float64).eval()
    # Copy by hand from the math (rows of inputs, columns of outputs; GPT-2 transposed) instead of our helpers.
    source = full.state_dict()
    target = dense.state_dict()
    for key, tensor in target.items():
        full_tensor = source[key]
        if full_tensor.shape == tensor.shape:
            tensor.copy_(full_tensor)
        else:
            index = tuple(slice(0, n) for n in tensor.shape)
            tensor.copy_(full_tensor[index])
    return dense


def logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's main output (logits, or the last hidden state of a base model)."""
    out = model(**inputs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
