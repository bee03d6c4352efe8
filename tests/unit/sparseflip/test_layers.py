"""Low-bit layers in both modes and convert_model on nn.Sequential and tiny offline HF models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hetero.sparseflip import (
    BinaryConv2d,
    LowBitConv2d,
    LowBitLinear,
    TernaryLinear,
    convert_model,
    lowbit_layers,
    quantize,
)
from lightning_hetero.sparseflip.quant import dequantize


def _tiny() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 8))


@pytest.mark.parametrize("mode", ["ste", "flip"])
@pytest.mark.parametrize("kind", ["ternary", "binary"])
@pytest.mark.parametrize("granularity", ["layer", "row"])
def test_convert_sequential_matches_quantized_reference(
    mode: str, kind: str, granularity: str, device: torch.device
) -> None:
    dense = _tiny().to(device)
    x = torch.randn(2, 1, 4, 4).to(device)
    reference = {}
    for i in (0, 3):
        codes, scale = quantize(dense[i].weight, kind, granularity)
        reference[i] = dequantize(codes, scale)
    hidden = torch.flatten(torch.relu(nn.functional.conv2d(x, reference[0], dense[0].bias, padding=1)), 1)
    expected = nn.functional.linear(hidden, reference[3], dense[3].bias)
    model = convert_model(_tiny(), kind, mode, granularity).to(device)
    assert isinstance(model[0], LowBitConv2d) and isinstance(model[3], LowBitLinear)
    assert model[0].kind == kind and model[3].mode == mode
    assert torch.allclose(model(x), expected, atol=1e-6)
    names = {name for name, _ in model.named_parameters()}
    if mode == "flip":
        assert names == {"0.bias", "3.bias"}  # no fp master weight
        assert model[3].codes.dtype == torch.int8
    else:
        assert "3.weight" in names


def test_flip_mode_backward_stores_code_grad(device: torch.device) -> None:
    layer = TernaryLinear(3, 2, bias=False, mode="flip", granularity="row").to(device)
    w = dequantize(layer.codes, layer.scale).clone().requires_grad_(True)
    x = torch.randn(4, 3).to(device)
    (x @ w.T).pow(2).sum().backward()
    layer(x).pow(2).sum().backward()
    assert layer.code_grad.device == device
    assert torch.allclose(layer.code_grad, w.grad * layer.scale)  # dL/dcodes = scale * dL/dW
    layer(x).pow(2).sum().backward()  # accumulates like .grad
    assert torch.allclose(layer.code_grad, 2 * w.grad * layer.scale)
    layer.zero_code_grad()
    assert layer.code_grad is None
    with torch.no_grad():
        layer(x)
    assert layer.code_grad is None


def test_ste_mode_trains_latent_weight() -> None:
    layer = LowBitLinear(3, 2, mode="ste")
    layer(torch.randn(4, 3)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_fixed_kind_classes() -> None:
    conv = BinaryConv2d(2, 3, 3, mode="flip")
    assert set(conv.codes.unique().tolist()) <= {-1, 1}
    with pytest.raises(TypeError, match="always"):
        TernaryLinear(2, 2, kind="binary")


def test_skip_patterns_and_heads_left_alone() -> None:
    model = nn.ModuleDict({"body": nn.Linear(2, 2), "head": nn.Linear(2, 2), "classifier": nn.Linear(2, 2)})
    convert_model(model)
    assert isinstance(model["body"], LowBitLinear)
    assert type(model["head"]) is nn.Linear and type(model["classifier"]) is nn.Linear
    convert_model(model, skip=())
    assert isinstance(model["head"], LowBitLinear)


def test_include_rejects_unsupported_types() -> None:
    with pytest.raises(ValueError, match=r"Embedding.*supported types are \['Linear', 'Conv2d', 'Conv1D'\]"):
        convert_model(nn.Sequential(nn.Embedding(3, 2)), include=[nn.Embedding])
    with pytest.raises(ValueError, match="Conv1d"):
        convert_model(nn.Sequential(), include=["Linear", nn.Conv1d])
    model = convert_model(nn.Sequential(nn.Linear(2, 2), nn.Conv2d(1, 1, 1)), include=["Conv2d"])
    assert type(model[0]) is nn.Linear and isinstance(model[1], LowBitConv2d)


def test_padding_mode_rejected() -> None:
    with pytest.raises(ValueError, match="padding_mode"):
        convert_model(nn.Sequential(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect")))


def test_gpt2_conv1d_transposed_layout() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16, vocab_size=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, Conv1D) and c_attn.weight.shape == (16, 48)
    codes, scale = quantize(c_attn.weight.t(), "ternary", "row")
    x = torch.randn(3, 16)
    expected = x @ dequantize(codes, scale).T + c_attn.bias
    convert_model(model, granularity="row")
    new = model.transformer.h[0].attn.c_attn
    assert isinstance(new, LowBitLinear) and new.weight.shape == (48, 16)
    assert torch.allclose(new(x), expected, atol=1e-6)
    assert not any(isinstance(m, Conv1D) for m in model.modules())
    assert type(model.lm_head) is nn.Linear and type(model.transformer.wte) is nn.Embedding
    ids = torch.randint(0, 32, (1, 8))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_llama_and_vit_tiny_configs() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=32,
            max_position_embeddings=16,
        )
    )
    convert_model(llama, mode="flip")
    converted = {name for name, _ in lowbit_layers(llama)}
    assert "model.layers.0.self_attn.q_proj" in converted and "model.layers.0.mlp.down_proj" in converted
    assert len(converted) == 7 and type(llama.lm_head) is nn.Linear
    ids = torch.randint(0, 32, (1, 6))
    llama(ids, labels=ids).loss.backward()
    assert all(layer.code_grad is not None for _, layer in lowbit_layers(llama))

    vit = transformers.ViTForImageClassification(
        transformers.ViTConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
            num_channels=1,
            num_labels=3,
        )
    )
    convert_model(vit, kind="binary")
    converted = {name for name, _ in lowbit_layers(vit)}
    assert not any("embeddings" in name or "classifier" in name for name in converted)
    assert type(vit.vit.embeddings.patch_embeddings.projection) is nn.Conv2d
    assert vit(torch.randn(2, 1, 8, 8)).logits.shape == (2, 3)
