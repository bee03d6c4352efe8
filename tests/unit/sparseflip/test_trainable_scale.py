"""Trainable per-row scales and ternary init with a chosen zero fraction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hetero.sparseflip import TernaryLinear, convert_model, lowbit_layers, ternary_quantize


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 8))


def test_trainable_scale_is_a_parameter_with_the_right_gradient() -> None:
    layer = TernaryLinear(3, 2, bias=False, mode="flip", granularity="row", trainable_scale=True)
    assert [name for name, _ in layer.named_parameters()] == ["scale"]
    assert set(layer.state_dict()) == {"scale", "codes"}
    w = (layer.codes.float() * layer.scale.detach()).requires_grad_(True)
    x = torch.randn(4, 3)
    (x @ w.T).pow(2).sum().backward()
    layer(x).pow(2).sum().backward()
    # dL/dscale_r = sum_j codes_rj * dL/dW_rj ; dL/dcodes = scale * dL/dW (no graph through the scale)
    assert torch.allclose(layer.scale.grad, (layer.codes.float() * w.grad).sum(1, keepdim=True), atol=1e-6)
    assert torch.allclose(layer.code_grad, w.grad * layer.scale.detach(), atol=1e-6)
    assert not layer.code_grad.requires_grad
    codes, scale = layer.quantized()
    assert not scale.requires_grad and codes.dtype == torch.int8


@pytest.mark.parametrize("granularity", ["layer", "row"])
def test_convert_model_trainable_scale_forward_and_round_trip(granularity: str) -> None:
    x = torch.randn(2, 1, 4, 4)
    fixed = convert_model(_net(), mode="flip", granularity=granularity)
    trainable = convert_model(_net(), mode="flip", granularity=granularity, trainable_scale=True)
    assert torch.allclose(fixed(x), trainable(x))
    names = {name for name, _ in trainable.named_parameters()}
    assert names == {"0.bias", "0.scale", "3.bias", "3.scale"}
    assert all(layer.trainable_scale for _, layer in lowbit_layers(trainable))
    with torch.no_grad():
        trainable[3].scale.mul_(3.0)
    copy = convert_model(_net(), mode="flip", granularity=granularity, trainable_scale=True)
    copy.load_state_dict(trainable.state_dict())
    assert torch.equal(copy(x), trainable(x))


def test_trainable_scale_needs_flip_mode() -> None:
    with pytest.raises(ValueError, match="flip"):
        convert_model(_net(), mode="ste", trainable_scale=True)
    with pytest.raises(ValueError, match="flip"):
        TernaryLinear(2, 2, mode="ste", trainable_scale=True)


def test_ternary_zero_fraction_by_hand() -> None:
    weight = torch.tensor([[0.1, -0.4, 0.3, -0.2], [1.0, 2.0, -3.0, 0.5]])
    codes, scale = ternary_quantize(weight, "row", zero_fraction=0.5)  # row medians of |W|: 0.25 and 1.5
    assert codes.tolist() == [[0, -1, 1, 0], [0, 1, -1, 0]]
    assert torch.allclose(scale, torch.tensor([[0.35], [2.5]]))
    codes, scale = ternary_quantize(weight, "layer", zero_fraction=0.0)
    assert codes.tolist() == [[1, -1, 1, -1], [1, 1, -1, 1]] and scale.shape == ()
    assert scale.item() == pytest.approx(weight.abs().mean().item())
    absmean = ternary_quantize(weight, "row")
    assert torch.equal(absmean[0], torch.round(weight / weight.abs().mean(1, keepdim=True)).clamp(-1, 1).to(torch.int8))
    with pytest.raises(ValueError, match="zero_fraction"):
        ternary_quantize(weight, zero_fraction=1.0)


def test_convert_model_zero_fraction_sets_the_share_of_zeros() -> None:
    torch.manual_seed(0)
    model = convert_model(nn.Linear(200, 16), mode="flip", granularity="row", zero_fraction=0.5)
    share = (model.codes == 0).float().mean().item()
    assert share == pytest.approx(0.5, abs=0.01)
    torch.manual_seed(0)
    default = convert_model(nn.Linear(200, 16), mode="flip", granularity="row")
    assert (default.codes == 0).float().mean().item() == pytest.approx(0.25, abs=0.05)
