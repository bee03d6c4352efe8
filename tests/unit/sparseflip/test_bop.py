"""BopFlip: the EMA / threshold / move rule against hand-computed examples, reset, int8 state, determinism, bytes."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.sparseflip import BinaryLinear, BopFlip, CodeLayout, TernaryLinear, convert_model


def _layer(codes: list[int], kind: str = "ternary") -> TernaryLinear:
    cls = TernaryLinear if kind == "ternary" else BinaryLinear
    layer = cls(len(codes), 1, bias=False, mode="flip")
    layer.codes.copy_(torch.tensor([codes], dtype=torch.int8))
    return layer


def test_ema_threshold_and_direction_by_hand() -> None:
    # gamma 0.5, threshold 0.35, no normalization: m1 = 0.5 g; m2 = 0.25 g + 0.5 g = 0.75 g
    layer = _layer([0, 0, 1, -1])
    opt = BopFlip([layer], gamma=0.5, threshold=0.35, normalize=False, reset=1.0)
    layer.code_grad = torch.tensor([[-0.5, 0.4, -1.0, 0.2]])
    assert opt.step() == 0  # m = [-0.25, 0.2, -0.5 (saturated +1 wants +1), 0.1]
    assert layer.codes.tolist() == [[0, 0, 1, -1]]
    assert torch.allclose(opt.momenta[0].float(), torch.tensor([[-0.25, 0.2, -0.5, 0.1]]), atol=1e-3)
    assert opt.step() == 1  # m = [-0.375, 0.3, -0.75, 0.15]: only index 0 passes > 0.35 and may move (up)
    assert layer.codes.tolist() == [[1, 0, 1, -1]]
    assert torch.allclose(opt.momenta[0].float(), torch.tensor([[-0.375, 0.3, -0.75, 0.15]]), atol=1e-3)


def test_binary_flips_when_momentum_agrees_with_the_weight() -> None:
    layer = _layer([1, 1, -1, -1], kind="binary")
    opt = BopFlip([layer], gamma=1.0, threshold=0.5, normalize=False, reset=1.0)
    layer.code_grad = torch.tensor([[1.0, -1.0, 1.0, -1.0]])  # sign(m) == code at index 0 and 3
    assert opt.step() == 2
    assert layer.codes.tolist() == [[-1, 1, -1, 1]]


def test_reset_zeroes_the_momentum_of_moved_codes_only() -> None:
    layer = _layer([0, 0])
    opt = BopFlip([layer], gamma=1.0, threshold=0.5, normalize=False)  # default reset 0
    layer.code_grad = torch.tensor([[-1.0, 0.2]])
    opt.step()
    assert layer.codes.tolist() == [[1, 0]]
    assert opt.momenta[0].float().tolist() == [[0.0, pytest.approx(0.2, abs=1e-3)]]
    half = BopFlip([_layer([0])], gamma=1.0, threshold=0.5, normalize=False, reset=0.5)
    half.layout.layers[0].code_grad = torch.tensor([[-1.0]])
    half.step()
    assert half.momenta[0].float().item() == pytest.approx(-0.5)


def test_ternary_without_reset_takes_a_second_step() -> None:
    layer = _layer([-1])
    opt = BopFlip([layer], gamma=1.0, threshold=0.5, normalize=False, reset=1.0)
    for _ in range(2):
        layer.code_grad = torch.tensor([[-1.0]])
        opt.step()
    assert layer.codes.tolist() == [[1]]


def test_normalize_divides_by_layer_rms() -> None:
    layer = _layer([0, 0])
    opt = BopFlip([layer], gamma=1.0, threshold=1.2, normalize=True)
    layer.code_grad = torch.tensor([[-300.0, 400.0]])  # rms = sqrt((9 + 16) / 2) * 100; normalized [-0.85, 1.13]
    assert opt.step() == 0
    layer.code_grad = torch.tensor([[-1e-6, 7e-6]])  # rms 5e-6: normalized [-0.2, 1.4] -> index 1 moves down
    assert opt.step() == 1 and layer.codes.tolist() == [[0, -1]]


def test_layer_without_gradient_keeps_its_state() -> None:
    a, b = _layer([0]), _layer([0])
    opt = BopFlip([a, b], gamma=0.5, threshold=10.0, normalize=False)
    a.code_grad = torch.tensor([[1.0]])
    opt.step()
    assert opt.momenta[0].float().item() == pytest.approx(0.5) and opt.momenta[1].float().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_deterministic_under_seed_and_state_dict_round_trip(dtype: torch.dtype) -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return convert_model(torch.nn.Sequential(torch.nn.Linear(20, 10), torch.nn.Linear(10, 3)), mode="flip")

    def run(net: torch.nn.Module, opt: BopFlip, steps: range) -> None:
        for step in steps:
            torch.manual_seed(100 + step)
            opt.zero_grad()
            net(torch.randn(8, 20)).pow(2).mean().backward()
            opt.step()

    first, second = model(), model()
    opt1 = BopFlip(first, gamma=0.3, threshold=0.3, dtype=dtype, seed=4)
    opt2 = BopFlip(second, gamma=0.3, threshold=0.3, dtype=dtype, seed=4)
    run(first, opt1, range(6))
    run(second, opt2, range(3))
    state, codes = opt2.state_dict(), {k: v.clone() for k, v in second.state_dict().items()}
    third = model()
    third.load_state_dict(codes)
    opt3 = BopFlip(third, gamma=0.3, threshold=0.3, dtype=dtype, seed=99)
    opt3.load_state_dict(state)
    run(second, opt2, range(3, 6))
    run(third, opt3, range(3, 6))
    assert torch.equal(CodeLayout(first).flat_codes(), CodeLayout(second).flat_codes())
    assert torch.equal(CodeLayout(third).flat_codes(), CodeLayout(first).flat_codes())
    assert all(torch.equal(a, b) for a, b in zip(opt1.momenta, opt3.momenta, strict=True))
    assert opt1.momenta[0].dtype == dtype
    assert not torch.equal(CodeLayout(model()).flat_codes(), CodeLayout(first).flat_codes())  # it did move


def test_int8_state_tracks_fp16() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(1, 256) for _ in range(20)]
    momenta = {}
    for dtype in (torch.float16, torch.int8):
        layer = _layer([0] * 256)
        opt = BopFlip([layer], gamma=0.1, threshold=100.0, normalize=False, dtype=dtype, seed=1)
        for grad in grads:
            layer.code_grad = grad / 100  # |m| stays well inside the int8 range (2 * threshold)
            opt.step()
        momenta[dtype] = opt.momenta[0].float() * (opt.unit if dtype == torch.int8 else 1.0)
    error = (momenta[torch.int8] - momenta[torch.float16]).abs().max().item()
    assert error < 4 * (2 * 100.0 / 127)  # within a few levels of the int8 grid


def test_state_bytes_fp16_and_int8() -> None:
    layer = TernaryLinear(64, 16, bias=False, mode="flip")  # 1024 codes
    assert BopFlip([layer]).state_bytes()["optimizer_bytes"] == 2048
    report = BopFlip([layer], dtype=torch.int8).state_bytes()
    assert report["optimizer_bytes"] == 1024 and report["total_bytes"] == 1024 + 4 + 1024
    assert report["adamw_fp32_bytes"] == 12 * 1024


def test_rejects_bad_arguments() -> None:
    layer = _layer([0])
    for kwargs in ({"gamma": 0.0}, {"gamma": 1.5}, {"threshold": 0.0}, {"reset": 2.0}, {"dtype": torch.float32}):
        with pytest.raises(ValueError):
            BopFlip([layer], **kwargs)
