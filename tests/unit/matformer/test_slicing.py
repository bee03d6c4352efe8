"""Slicing against independent references: dense models of size h/2^t, zeroed-suffix models, analytic counts."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch import nn

from lightning_hetero.matformer.adapters import BASE_SIZE_KEY, TIER_KEY, WIDTHS_KEY, ffn_parameters, find_ffns
from lightning_hetero.matformer.prefix_state import (
    embed_prefix,
    pad_prefix,
    prefix_state_dict,
    scatter_prefix_into_full,
)
from lightning_hetero.matformer.slicing import mask_suffix_gradients, slice_model, tier_view
from tests.unit.matformer._tiny_hf import FAMILIES, H, dense_reference, logits, n_ffns

TOL = {"atol": 1e-6, "rtol": 0.0}
NAMES = list(FAMILIES)


def _inputs(name: str, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in FAMILIES[name].inputs(torch.Generator().manual_seed(1)).items()}


def _loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    # A fixed random projection of the output, so every output element contributes a distinct gradient.
    out = logits(model, inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype).to(out.device)
    return (out * weight).sum()


@pytest.mark.parametrize("tier", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_tier_forward_equals_a_dense_model_of_that_size(name: str, tier: int, device: torch.device) -> None:
    family = FAMILIES[name]
    full = family.build().to(device)
    inputs = _inputs(name, device)
    expected = logits(dense_reference(family, full, H >> tier).to(device), inputs)
    with torch.no_grad():
        full_out = logits(full, inputs)
        with tier_view(full, tier):
            viewed = logits(full, inputs)
        sliced = logits(slice_model(copy.deepcopy(full), tier), inputs)
        after = logits(full, inputs)
    assert not torch.allclose(full_out, expected, **TOL)  # the tier really changes the function
    torch.testing.assert_close(viewed, expected, **TOL)
    torch.testing.assert_close(sliced, expected, **TOL)
    torch.testing.assert_close(after, full_out, atol=0, rtol=0)  # the view is gone again


@pytest.mark.parametrize("name", NAMES)
def test_slice_model_parameter_count_shrinks_analytically(name: str) -> None:
    family = FAMILIES[name]
    full = family.build()
    before = sum(p.numel() for p in full.parameters())
    for tier in (1, 2):
        model = slice_model(copy.deepcopy(full), tier)
        removed = H - (H >> tier)
        d = 16
        per_ffn = removed * (family.n_inputs_per_ffn * (d + int(family.input_bias)) + d)
        assert sum(p.numel() for p in model.parameters()) == before - n_ffns(full) * per_ffn


@pytest.mark.parametrize("tier", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_tier_view_gradients_suffix_zero_prefix_equals_dense(name: str, tier: int, device: torch.device) -> None:
    family = FAMILIES[name]
    full = family.build().to(device)
    width = H >> tier
    dense = dense_reference(family, full, width).to(device)
    inputs = _inputs(name, device)
    _loss(dense, inputs).backward()
    with tier_view(full, tier):
        _loss(full, inputs).backward()
    dense_params = dict(dense.named_parameters())
    for spec in ffn_parameters(full):
        grad = dict(full.named_parameters())[spec.name].grad
        suffix = grad.narrow(spec.axis, width, H - width)
        assert torch.count_nonzero(suffix) == 0, spec.name  # exactly zero, not just small
        torch.testing.assert_close(grad.narrow(spec.axis, 0, width), dense_params[spec.name].grad, **TOL)
    ffn_names = {p.name for p in ffn_parameters(full)}
    for param_name, param in full.named_parameters():  # shared parameters get the dense model's gradient too
        if param_name not in ffn_names and param.grad is not None:
            torch.testing.assert_close(param.grad, dense_params[param_name].grad, **TOL)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5-gated", "bert"])
def test_per_layer_widths_forward(name: str) -> None:
    family = FAMILIES[name]
    full = family.build()
    blocks = find_ffns(full)
    widths = [8, 32, 16, 4][: len(blocks)]
    # Reference from the math: unit j of FFN l contributes nothing iff its output column (W_out[:, j]) is zero.
    reference = copy.deepcopy(full)
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for block, width in zip(blocks, widths, strict=True):
            out_weight = block.parameters[-1]  # the output projection's weight is listed last
            params[out_weight.name].narrow(out_weight.axis, width, H - width).zero_()
    inputs = _inputs(name)
    with torch.no_grad():
        expected = logits(reference, inputs)
        with tier_view(full, widths=widths):
            viewed = logits(full, inputs)
        sliced_model = slice_model(copy.deepcopy(full), widths=widths)
        sliced = logits(sliced_model, inputs)
    torch.testing.assert_close(viewed, expected, **TOL)
    torch.testing.assert_close(sliced, expected, **TOL)
    assert [b.width for b in find_ffns(sliced_model)] == widths
    assert getattr(sliced_model.config, WIDTHS_KEY) == widths


def test_gpt2_c_proj_bias_is_not_sliced() -> None:
    model = slice_model(FAMILIES["gpt2"].build(), 2)
    mlp = model.transformer.h[0].mlp
    assert mlp.c_fc.weight.shape == (16, 8) and mlp.c_fc.bias.shape == (8,)
    assert mlp.c_proj.weight.shape == (8, 16) and mlp.c_proj.bias.shape == (16,)
    assert (mlp.c_fc.nf, mlp.c_proj.nx) == (8, 8)
    assert model.config.n_inner == 8


def test_slice_model_records_metadata_and_never_slices_twice() -> None:
    model = slice_model(FAMILIES["llama"].build(), 1)
    assert (model.config.intermediate_size, getattr(model.config, BASE_SIZE_KEY), getattr(model.config, TIER_KEY)) == (
        16,
        H,
        1,
    )
    assert find_ffns(model)[0].full_size == H
    slice_model(model, 1)  # tier 1 of a tier-1 model: no change
    assert model.model.layers[0].mlp.up_proj.weight.shape == (16, 16)
    slice_model(model, 2)  # tier 2 is relative to the full size: 8 units, not 4
    assert model.model.layers[0].mlp.up_proj.weight.shape == (8, 16)
    with pytest.raises(ValueError, match="cannot grow to 16"):
        slice_model(model, 1)


def test_linear_size_attributes_follow_the_weights() -> None:
    model = slice_model(FAMILIES["llama"].build(), 2)
    mlp = model.model.layers[1].mlp
    assert (mlp.gate_proj.out_features, mlp.up_proj.out_features, mlp.down_proj.in_features) == (8, 8, 8)
    assert mlp.down_proj.bias.shape == (16,)  # output bias whole


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of tier"),
        ({"tier": 1, "widths": [16, 16]}, "exactly one of tier"),
        ({"widths": [16]}, "widths has 1 entries but the model has 2 FFNs"),
        ({"widths": [16, 0]}, r"widths\[1\] must be an int in \[1, 32\]"),
        ({"tier": 6}, "divisible by 2\\*\\*6"),
        ({"tier": -1}, "tier must be >= 0"),
    ],
)
def test_bad_tier_or_widths(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        slice_model(FAMILIES["qwen2"].build(), **kwargs)


def test_tier_view_keeps_parameters_and_restores_on_error() -> None:
    model = FAMILIES["qwen3"].build()
    names = [(n, p.shape) for n, p in model.named_parameters()]
    with pytest.raises(KeyError):
        with tier_view(model, 1):
            assert [(n, p.shape) for n, p in model.named_parameters()] == names
            raise KeyError("boom")
    assert all("forward" not in m.__dict__ for m in model.modules())
    with tier_view(model, 1), pytest.raises(RuntimeError, match="already patched"):
        with tier_view(model, 2):
            pass


def test_mask_suffix_gradients_on_a_full_forward() -> None:
    model = FAMILIES["gpt2"].build()
    inputs = _inputs("gpt2")
    _loss(model, inputs).backward()
    unmasked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    handles = mask_suffix_gradients(model, 1)
    _loss(model, inputs).backward()
    params = dict(model.named_parameters())
    for spec in ffn_parameters(model):
        grad = params[spec.name].grad
        assert torch.count_nonzero(grad.narrow(spec.axis, 16, 16)) == 0
        torch.testing.assert_close(grad.narrow(spec.axis, 0, 16), unmasked[spec.name].narrow(spec.axis, 0, 16))
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("name", NAMES)
def test_prefix_state_dict_equals_sliced_state_dict(name: str) -> None:
    family = FAMILIES[name]
    full = family.build()
    with torch.device("meta"):  # ffn_params without allocating a model
        specs = ffn_parameters(family.model_class(family.make_config(H)))
    for kwargs in ({"tier": 1}, {"widths": [8, 16, 4, 32][: n_ffns(full)]}):
        expected = slice_model(copy.deepcopy(full), **kwargs).state_dict()
        got = prefix_state_dict(full.state_dict(), specs, **kwargs)
        assert list(got) == list(expected)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], atol=0, rtol=0)


def test_prefix_state_dict_errors() -> None:
    full = FAMILIES["llama"].build()
    specs = ffn_parameters(full)
    with pytest.raises(KeyError, match="not in the state dict"):
        prefix_state_dict({"x": torch.zeros(1)}, specs, tier=1)
    sliced = slice_model(copy.deepcopy(full), 1).state_dict()
    with pytest.raises(ValueError, match="needs a full \\(tier-0\\) checkpoint"):
        prefix_state_dict(sliced, specs, tier=1)


def test_scatter_trained_prefix_back_into_full_weights() -> None:
    family = FAMILIES["gpt2"]
    full = family.build()
    before = {n: p.detach().clone() for n, p in full.named_parameters()}
    sliced = slice_model(copy.deepcopy(full), 1)
    with torch.no_grad():  # "train" the tier: change every weight
        for param in sliced.parameters():
            param.add_(torch.randn_like(param))
    scatter_prefix_into_full(full, sliced.state_dict(), ffn_parameters(full))
    inputs = _inputs("gpt2")
    with torch.no_grad(), tier_view(full, 1):
        torch.testing.assert_close(logits(full, inputs), logits(sliced, inputs), **TOL)
    params = dict(full.named_parameters())
    for spec in ffn_parameters(full):  # the suffix (never trained by this tier) is untouched
        suffix = params[spec.name].narrow(spec.axis, 16, 16)
        torch.testing.assert_close(suffix, before[spec.name].narrow(spec.axis, 16, 16), atol=0, rtol=0)


def test_embed_and_pad_prefix(device: torch.device) -> None:
    full = torch.arange(12.0, device=device).reshape(3, 4)
    embed_prefix(full, -torch.ones(3, 2, device=device), axis=1)
    assert full.tolist() == [[-1, -1, 2, 3], [-1, -1, 6, 7], [-1, -1, 10, 11]]
    padded = pad_prefix(torch.ones(2, 3, device=device), 4, axis=0)
    assert padded.device == device
    assert padded.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="other axes must match"):
        embed_prefix(torch.zeros(3, 4), torch.zeros(2, 2), axis=1)
    with pytest.raises(ValueError, match="more than full_size"):
        pad_prefix(torch.ones(5), 4, axis=0)


def test_sliced_model_round_trips_through_save_pretrained(tmp_path) -> None:
    model = slice_model(FAMILIES["t5-gated"].build(), 2)
    model.save_pretrained(tmp_path)
    loaded = tf.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    inputs = _inputs("t5-gated")
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), **TOL)
    assert (loaded.config.d_ff, getattr(loaded.config, BASE_SIZE_KEY)) == (8, H)
    assert find_ffns(loaded)[0].full_size == H  # the full size survives the round trip


def test_tier_view_with_activation_checkpointing() -> None:
    family = FAMILIES["llama"]
    full = family.build().train()
    full.activation_checkpointing_enable()
    dense = dense_reference(family, full, 16).train()
    dense.activation_checkpointing_enable()
    inputs = _inputs("llama")
    with tier_view(full, 1):
        full(**inputs, labels=inputs["input_ids"], use_cache=False).loss.backward()
    dense(**inputs, labels=inputs["input_ids"], use_cache=False).loss.backward()
    grad = full.model.layers[0].mlp.down_proj.weight.grad
    torch.testing.assert_close(grad[:, :16], dense.model.layers[0].mlp.down_proj.weight.grad, **TOL)
    assert torch.count_nonzero(grad[:, 16:]) == 0
