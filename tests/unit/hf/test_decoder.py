"""Decoder discovery: the supported HF causal LM is found anywhere in a module tree, with a clear refusal otherwise."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from lightning_hetero.hf.decoder import SUPPORTED_FAMILIES, find_decoder
from tests.unit.subspace_pipeline._tiny import LAYERS, tiny_model


def test_find_decoder_inside_a_wrapper_module() -> None:
    wrapper = torch.nn.Module()
    wrapper.net = tiny_model()
    parts = find_decoder(wrapper)
    assert parts.path == "net" and parts.family == "llama" and parts.num_layers == LAYERS


def test_writer_types_decide_what_a_residual_writer_may_be() -> None:
    model = tiny_model()
    model.model.layers[1].self_attn.o_proj = torch.nn.Identity()
    with pytest.raises(ValueError, match="layer 1 of LlamaForCausalLM has no nn.Linear at 'self_attn.o_proj'"):
        find_decoder(model)
    assert find_decoder(model, writer_types=(torch.nn.Linear, torch.nn.Identity)).num_layers == LAYERS


def test_an_unsupported_model_is_named_with_the_supported_families() -> None:
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16))
    with pytest.raises(ValueError, match="found: .*GPT2LMHeadModel.*supports " + ", ".join(SUPPORTED_FAMILIES)):
        find_decoder(gpt2)
