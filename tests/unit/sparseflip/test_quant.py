"""Quantizer math against hand-computed examples and the straight-through gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.sparseflip.quant import (
    binary_quantize,
    compute_scale,
    dequantize,
    quantize_ste,
    sign_ste,
    ternary_quantize,
)


def test_ternary_absmean_by_hand(device: torch.device) -> None:
    w = torch.tensor([[0.9, -0.1, 0.3, -1.2], [0.0, 0.4, -0.5, 0.2]], device=device)
    # mean|W| = (0.9 + 0.1 + 0.3 + 1.2 + 0 + 0.4 + 0.5 + 0.2) / 8 = 0.45
    codes, scale = ternary_quantize(w)
    assert scale.shape == () and scale.item() == pytest.approx(0.45)
    # W / 0.45 = [2, -0.22, 0.67, -2.67], [0, 0.89, -1.11, 0.44] -> round, clamp
    assert codes.tolist() == [[1, 0, 1, -1], [0, 1, -1, 0]]
    assert codes.dtype == torch.int8 and codes.device == device and scale.device == device
    assert torch.allclose(dequantize(codes, scale), 0.45 * codes.float())


def test_ternary_per_row_by_hand(device: torch.device) -> None:
    w = torch.tensor([[0.9, -0.1, 0.3, -1.2], [0.0, 0.4, -0.5, 0.2]], device=device)
    codes, scale = ternary_quantize(w, "row")
    # row scales 2.5 / 4 = 0.625 and 1.1 / 4 = 0.275
    assert scale.shape == (2, 1)
    assert scale.flatten().tolist() == pytest.approx([0.625, 0.275])
    # row 0: [1.44, -0.16, 0.48, -1.92] -> [1, 0, 0, -1]; row 1: [0, 1.45, -1.82, 0.73] -> [0, 1, -1, 1]
    assert codes.tolist() == [[1, 0, 0, -1], [0, 1, -1, 1]]


def test_binary_sign_and_zero_maps_to_plus_one(device: torch.device) -> None:
    w = torch.tensor([[0.5, -0.25], [0.0, -1.0]], device=device)
    codes, scale = binary_quantize(w)
    assert codes.tolist() == [[1, -1], [1, -1]]
    assert scale.item() == pytest.approx(0.4375)
    codes, scale = binary_quantize(w, "row")
    assert scale.flatten().tolist() == pytest.approx([0.375, 0.5])


def test_conv_weight_row_scale_shape_and_zero_tensor() -> None:
    w = torch.randn(3, 2, 3, 3)
    assert compute_scale(w, "row").shape == (3, 1, 1, 1)
    codes, scale = ternary_quantize(torch.zeros(2, 2))
    assert codes.abs().sum() == 0 and scale.item() > 0  # eps floor, no division by zero


def test_bad_kind_and_granularity() -> None:
    with pytest.raises(ValueError, match="granularity"):
        ternary_quantize(torch.ones(2, 2), "column")
    with pytest.raises(ValueError, match="kind"):
        quantize_ste(torch.ones(2, 2, requires_grad=True), "quaternary")


def test_ste_forward_is_quantized_and_gradient_passes_through(device: torch.device) -> None:
    w = torch.tensor([[0.9, -0.1], [0.3, -1.2]], device=device, requires_grad=True)
    out = quantize_ste(w, "ternary")
    codes, scale = ternary_quantize(w)
    assert torch.equal(out.detach(), dequantize(codes, scale))
    upstream = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
    out.backward(upstream)
    assert torch.equal(w.grad, upstream)


def test_ste_clip_zeroes_gradient_outside(device: torch.device) -> None:
    w = torch.tensor([0.1, -0.2, 3.0], device=device, requires_grad=True)  # scale = 1.1; |3.0| > 1.1
    quantize_ste(w, "binary", clip=1.0).sum().backward()
    assert w.grad.tolist() == [1.0, 1.0, 0.0]


def test_sign_ste_hardtanh_gradient(device: torch.device) -> None:
    x = torch.tensor([-2.0, -0.5, 0.0, 0.7, 1.5], device=device, requires_grad=True)
    y = sign_ste(x)
    assert y.tolist() == [-1.0, -1.0, 1.0, 1.0, 1.0]
    y.sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
