"""FFN discovery per HF family: names, axes, biases, wrappers, config size fields, errors."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

from lightning_hetero.matformer.adapters import (
    FFNAdapter,
    UnsupportedModelError,
    config_intermediate_size,
    ffn_parameters,
    find_ffns,
    intermediate_size_field,
    register_adapter,
    registered_adapters,
    unregister_adapter,
)
from tests.unit.matformer._tiny_hf import FAMILIES, H

# Expected FFN parameters of block 0, relative to its root: (name, axis). The output bias is never listed.
EXPECTED = {
    "llama": [
        ("gate_proj.weight", 0),
        ("gate_proj.bias", 0),
        ("up_proj.weight", 0),
        ("up_proj.bias", 0),
        ("down_proj.weight", 1),
    ],
    "mistral": [("gate_proj.weight", 0), ("up_proj.weight", 0), ("down_proj.weight", 1)],
    "qwen2": [("gate_proj.weight", 0), ("up_proj.weight", 0), ("down_proj.weight", 1)],
    "qwen3": [("gate_proj.weight", 0), ("up_proj.weight", 0), ("down_proj.weight", 1)],
    "olmo2": [("gate_proj.weight", 0), ("up_proj.weight", 0), ("down_proj.weight", 1)],
    "gpt2": [("c_fc.weight", 1), ("c_fc.bias", 0), ("c_proj.weight", 0)],
    "t5": [("wi.weight", 0), ("wo.weight", 1)],
    "t5-gated": [("wi_0.weight", 0), ("wi_1.weight", 0), ("wo.weight", 1)],
    "vit": [("fc1.weight", 0), ("fc1.bias", 0), ("fc2.weight", 1)],
    "bert": [("intermediate.dense.weight", 0), ("intermediate.dense.bias", 0), ("output.dense.weight", 1)],
}
ROOT0 = {
    "gpt2": "transformer.h.0.mlp",
    "t5": "encoder.block.0.layer.1.DenseReluDense",
    "t5-gated": "encoder.block.0.layer.1.DenseReluDense",
    "vit": "vit.layers.0.mlp",
    "bert": "encoder.layer.0",
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_find_ffns_names_axes_and_sizes(name: str) -> None:
    model = FAMILIES[name].build()
    blocks = find_ffns(model)
    assert len(blocks) == (4 if name.startswith("t5") else 2)
    assert [b.layer for b in blocks] == list(range(len(blocks)))
    block = blocks[0]
    assert block.family == name
    assert block.path == ROOT0.get(name, "model.layers.0.mlp")
    assert (block.width, block.full_size, block.model_size) == (H, H, 16)
    assert [(p.name[len(block.path) + 1 :], p.axis) for p in block.parameters] == EXPECTED[name]
    params = dict(model.named_parameters())
    for spec in block.parameters:
        assert params[spec.name].shape[spec.axis] == H  # the axis really is the hidden one
        assert (spec.full_size, spec.layer) == (H, 0)


def test_t5_decoder_ffns_are_numbered_after_the_encoder() -> None:
    blocks = find_ffns(FAMILIES["t5-gated"].build())
    assert [b.path for b in blocks[2:]] == [
        "decoder.block.0.layer.2.DenseReluDense",
        "decoder.block.1.layer.2.DenseReluDense",
    ]
    assert [b.layer for b in blocks] == [0, 1, 2, 3]


def test_gpt2_conv1d_axes_and_unsliced_output_bias() -> None:
    model = FAMILIES["gpt2"].build()
    names = {p.name: p.axis for p in ffn_parameters(model)}
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (16, H)  # Conv1D: [in, out]
    assert names["transformer.h.0.mlp.c_fc.weight"] == 1
    assert names["transformer.h.0.mlp.c_proj.weight"] == 0
    assert "transformer.h.0.mlp.c_proj.bias" not in names
    assert not any(".attn." in n for n in names)  # attention's own c_proj is not an FFN


def test_bert_attention_output_is_not_an_ffn() -> None:
    names = [p.name for p in ffn_parameters(FAMILIES["bert"].build())]
    assert not any("attention" in n for n in names)
    assert "encoder.layer.0.output.dense.bias" not in names


def test_wrapped_model_names_match_the_wrapper() -> None:
    class UserModule(nn.Module):  # stands in for a user's LightningModule holding an HF model
        def __init__(self) -> None:
            super().__init__()
            self.model = FAMILIES["qwen2"].build()

    wrapper = UserModule()
    names = {p.name for p in ffn_parameters(wrapper)}
    assert "model.model.layers.1.mlp.down_proj.weight" in names
    assert names <= dict(wrapper.named_parameters()).keys()


def test_base_model_without_head_and_a_bare_ffn() -> None:
    model = FAMILIES["llama"].build()
    assert find_ffns(model.model)[0].path == "layers.0.mlp"
    (bare,) = find_ffns(model.model.layers[1].mlp)  # the FFN module itself is the root
    assert bare.path == "" and [p.name for p in bare.parameters][-1] == "down_proj.weight"


def test_unknown_model_error_names_families_and_the_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(UnsupportedModelError) as info:
        find_ffns(model)
    message = str(info.value)
    for family in ("llama", "mistral", "qwen2", "qwen3", "olmo2", "gpt2", "t5-gated", "vit", "bert"):
        assert family in message
    assert "register_adapter(FFNAdapter(" in message
    assert "Sequential" in message


def test_register_a_custom_adapter() -> None:
    class MyMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_in = nn.Linear(4, 12)
            self.w_out = nn.Linear(12, 4)

    model = nn.ModuleList([MyMLP(), MyMLP()])
    adapter = FFNAdapter("mine", ("MyMLP",), ("w_in",), "w_out", ("mine",), "ffn_dim")
    register_adapter(adapter)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_adapter(adapter)
        blocks = find_ffns(model)
        assert [b.path for b in blocks] == ["0", "1"]
        assert [p.name for p in blocks[1].parameters] == ["1.w_in.weight", "1.w_in.bias", "1.w_out.weight"]
        assert intermediate_size_field({"model_type": "mine"}) == "ffn_dim"
    finally:
        unregister_adapter("mine")
    assert "mine" not in registered_adapters()


def test_register_rejects_conflicting_size_field() -> None:
    with pytest.raises(ValueError, match="already keeps its FFN size in 'intermediate_size'"):
        register_adapter(FFNAdapter("llama-x", ("XMLP",), ("up",), "down", ("llama",), "ffn_size"))


def test_adapter_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="module_types must be a tuple"):
        FFNAdapter("bad", "MyMLP", ("up",), "down")  # type: ignore[arg-type]


def test_legacy_vit_layer_structure() -> None:
    class ViTLayer(nn.Module):  # transformers < 5 layout: intermediate.dense / output.dense
        def __init__(self) -> None:
            super().__init__()
            self.intermediate = nn.Module()
            self.intermediate.dense = nn.Linear(4, 8)
            self.output = nn.Module()
            self.output.dense = nn.Linear(8, 4)

    blocks = find_ffns(nn.ModuleList([ViTLayer()]))
    assert blocks[0].family == "vit-legacy"
    assert [p.name for p in blocks[0].parameters] == [
        "0.intermediate.dense.weight",
        "0.intermediate.dense.bias",
        "0.output.dense.weight",
    ]


def test_partially_sliced_ffn_is_rejected() -> None:
    model = FAMILIES["mistral"].build()
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight = nn.Parameter(mlp.up_proj.weight.detach()[:8].clone())
    with pytest.raises(ValueError, match="inconsistent projection sizes"):
        find_ffns(model)


@pytest.mark.parametrize(
    ("config", "field", "size"),
    [
        (tf.LlamaConfig(intermediate_size=40), "intermediate_size", 40),
        (tf.Qwen3Config(intermediate_size=48), "intermediate_size", 48),
        (tf.GPT2Config(n_embd=24, n_inner=None), "n_inner", 96),
        (tf.GPT2Config(n_embd=24, n_inner=50), "n_inner", 50),
        (tf.T5Config(d_ff=72, feed_forward_proj="gated-gelu"), "d_ff", 72),
        (tf.ViTConfig(intermediate_size=56), "intermediate_size", 56),
        (tf.BertConfig(intermediate_size=64), "intermediate_size", 64),
    ],
)
def test_config_intermediate_size_per_family(config: tf.PretrainedConfig, field: str, size: int) -> None:
    assert intermediate_size_field(config) == field
    assert config_intermediate_size(config) == size
    assert config_intermediate_size(config.to_dict()) == size


def test_unknown_model_type_size_field_error() -> None:
    with pytest.raises(UnsupportedModelError, match="known model types: .*gpt2"):
        intermediate_size_field({"model_type": "bloom"})


def test_meta_device_model_gives_ffn_parameters() -> None:
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(FAMILIES["llama"].make_config(H))
    assert len(ffn_parameters(model)) == 2 * 5
