"""Flip optimizers: move rules incl. saturation, determinism under a seed, accumulators, state bytes."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.sparseflip import (
    AccumulatedFlip,
    BinaryLinear,
    CodeLayout,
    StochasticFlip,
    TernaryLinear,
    TopKFlip,
    apply_moves,
    convert_model,
    move_allowed,
    topk_moves,
)


def _layer(codes: list[int], grad: list[float], kind: str = "ternary") -> TernaryLinear:
    cls = TernaryLinear if kind == "ternary" else BinaryLinear
    layer = cls(len(codes), 1, bias=False, mode="flip")
    layer.codes.copy_(torch.tensor([codes], dtype=torch.int8))
    layer.code_grad = torch.tensor([grad])
    return layer


def test_ternary_moves_one_step_and_respects_saturation(device: torch.device) -> None:
    codes = torch.tensor([-1, 0, 1, 1, -1, 0, 1], dtype=torch.int8, device=device)
    direction = torch.tensor([1, 1, 1, -1, -1, -1, 0], dtype=torch.int8, device=device)
    assert move_allowed(codes, direction).tolist() == [True, True, False, True, False, True, False]
    apply_moves(codes, direction, "ternary")
    assert codes.tolist() == [0, 1, 1, 0, -1, -1, 1]


def test_binary_flips_sign_only_towards_direction(device: torch.device) -> None:
    codes = torch.tensor([-1, 1, 1, -1], dtype=torch.int8, device=device)
    apply_moves(codes, torch.tensor([1, 1, -1, -1], dtype=torch.int8, device=device), "binary")
    assert codes.tolist() == [1, 1, -1, -1]


def test_stochastic_flip_probability_one_and_zero() -> None:
    # g < 0 -> move up; lr*|g| >= 1 -> always; g = 0 -> never; saturated +1 with g < 0 -> not moved
    layer = _layer([0, -1, 1, 0, 0], [-5.0, -5.0, -5.0, 0.0, 5.0])
    moved = StochasticFlip([layer], lr=1.0).step()
    assert layer.codes.tolist() == [[1, 0, 1, 0, -1]] and moved == 3


def test_stochastic_flip_rate_matches_probability() -> None:
    layer = TernaryLinear(1000, 4, bias=False, mode="flip")
    layer.codes.zero_()
    layer.code_grad = torch.full((4, 1000), -0.5)
    moved = StochasticFlip([layer], lr=0.2, seed=3).step()  # p = 0.1
    assert 300 < moved < 500


def test_stochastic_flip_is_deterministic_under_seed() -> None:
    def run(seed: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = convert_model(torch.nn.Sequential(torch.nn.Linear(20, 10), torch.nn.Linear(10, 3)), mode="flip")
        opt = StochasticFlip(model, lr=3.0, seed=seed)
        for step in range(5):
            torch.manual_seed(100 + step)
            opt.zero_grad()
            model(torch.randn(8, 20)).pow(2).mean().backward()
            opt.step()
        return CodeLayout(model).flat_codes()

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))


def test_topk_per_layer_and_global() -> None:
    a = _layer([0, 0, 1, 0], [-1.0, 3.0, -9.0, 2.0])  # index 2 is saturated (+1, g < 0 wants +1)
    b = _layer([0, 0], [0.5, -2.5])
    TopKFlip([a, b], k=1, scope="layer").step()
    assert a.codes.tolist() == [[0, -1, 1, 0]] and b.codes.tolist() == [[0, 1]]
    a = _layer([0, 0, 1, 0], [-1.0, 3.0, -9.0, 2.0])
    b = _layer([0, 0], [0.5, -2.5])
    assert TopKFlip([a, b], k=2, scope="global").step() == 2
    assert a.codes.tolist() == [[0, -1, 1, 0]] and b.codes.tolist() == [[0, 1]]


def test_topk_ties_go_to_lower_index_and_zero_grad_never_moves() -> None:
    indices, directions = topk_moves(torch.tensor([1.0, -1.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.int8), 5)
    assert indices.tolist() == [0, 1, 2] and directions.tolist() == [-1, 1, -1]
    indices, _ = topk_moves(torch.tensor([1.0, -1.0, 1.0]), torch.zeros(3, dtype=torch.int8), 2)
    assert indices.tolist() == [0, 1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_accumulator_fires_at_threshold_and_resets(dtype: torch.dtype) -> None:
    layer = _layer([0, 0, 1], [-0.3, 0.1, -0.3])
    opt = AccumulatedFlip([layer], lr=1.0, threshold=1.0, dtype=dtype, seed=0)
    opt.step()
    opt.step()
    assert layer.codes.tolist() == [[0, 0, 1]]
    fired = [opt.step() for _ in range(4)]
    # the saturated +1 also fires (and is reset) but cannot move; index 1 accumulates only 0.6
    assert layer.codes.tolist()[0][:2] == [1, 0] and sum(fired) == 1
    assert opt.accumulators[0].dtype == dtype
    assert opt.accumulators[0].float()[0, 1] > 0


def test_state_dict_resumes_bit_identically() -> None:
    layer = _layer([0] * 6, [-0.2, 0.4, -0.3, 0.1, 0.2, -0.5])
    opt = AccumulatedFlip([layer], lr=1.0, threshold=1.0, dtype=torch.int8, seed=5)
    opt.step()
    state, codes = opt.state_dict(), layer.codes.clone()
    opt.step()
    after = layer.codes.clone()
    layer.codes.copy_(codes)
    opt.load_state_dict(state)
    opt.step()
    assert torch.equal(layer.codes, after)


def test_state_bytes_against_adamw() -> None:
    layer = TernaryLinear(64, 16, bias=False, mode="flip")  # 1024 codes, one fp32 scale
    report = StochasticFlip([layer], lr=0.1).state_bytes()
    assert report["params"] == 1024 and report["adamw_fp32_bytes"] == 12 * 1024
    assert report["weight_bytes"] == 1024 + 4 and report["weight_bytes_packed"] == 256 + 4
    assert report["optimizer_bytes"] == 0 and report["total_bytes"] == 1028
    acc = AccumulatedFlip([layer], lr=0.1, dtype=torch.float16).state_bytes()
    assert acc["optimizer_bytes"] == 2048 and acc["total_bytes_packed"] == 256 + 4 + 2048


def test_layout_rejects_ste_layers() -> None:
    with pytest.raises(ValueError, match="flip-mode"):
        CodeLayout([TernaryLinear(2, 2, mode="ste")])
