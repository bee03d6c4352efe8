"""The flip rules of the sparseflip exchange: top-k, and Bop on the aggregate (equal to BopFlip when dense)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_hetero.sparseflip import BopFlip, CodeLayout, convert_model
from lightning_hetero.sparseflip.layers import LowBitLinear
from lightning_hetero.sparseflip.rules import BopRule, TopKRule


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5))  # tanh: no exactly-zero gradients
    return convert_model(model, kind="ternary", mode="flip", granularity="row", skip=())


def _backward(model: nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 12, generator=generator), torch.randint(0, 5, (32,), generator=generator)
    nn.functional.cross_entropy(model(x), y).backward()


def test_bop_rule_on_a_dense_gradient_moves_exactly_like_bop_flip():
    reference, model = _model(), _model()
    bop = BopFlip(reference, gamma=0.3, threshold=0.2, normalize=True, reset=0.0)
    layout = CodeLayout(model)
    rule = BopRule(layout.offsets, gamma=0.3, threshold=0.2, reset=0.0)
    moved = 0
    for step in range(6):
        _backward(reference, step)
        _backward(model, step)
        bop.step()
        bop.zero_grad()
        indices, directions = rule(layout.flat_grad(), layout.flat_codes())
        moved += layout.apply(indices, directions)
        layout.zero_grad()
        assert torch.equal(CodeLayout(reference).flat_codes(), layout.flat_codes()), step
    assert moved > 0


def test_bop_rule_caps_moves_by_momentum_and_keeps_the_rest():
    rule = BopRule([0, 4], gamma=1.0, threshold=0.5, reset=0.0, cap=1)
    codes = torch.zeros(4, dtype=torch.int8)
    mean = torch.tensor([1.0, -3.0, 0.0, 2.0])  # rms over sent entries = sqrt(14/3)
    indices, directions = rule(mean, codes)
    assert indices.tolist() == [1] and directions.tolist() == [1]  # the largest |m| only, against its sign
    assert float(rule.momentum[1]) == 0.0  # reset after the move
    assert float(rule.momentum[3]) > 0.5  # above threshold, not moved: waits for the next step


def test_saturated_codes_never_move_and_state_round_trips():
    rule = BopRule([0, 3], gamma=1.0, threshold=0.1)
    codes = torch.tensor([1, -1, 0], dtype=torch.int8)
    indices, directions = rule(torch.tensor([-1.0, 1.0, 1.0]), codes)  # +1 pushed up, -1 pushed down: saturated
    assert indices.tolist() == [2] and directions.tolist() == [-1]
    restored = BopRule([0, 3], gamma=1.0, threshold=0.1)
    restored.load_state_dict(copy.deepcopy(rule.state_dict()))
    assert torch.equal(restored.momentum, rule.momentum)
    with pytest.raises(ValueError, match="momenta"):
        BopRule([0, 5], gamma=1.0, threshold=0.1).load_state_dict(rule.state_dict())


def test_topk_rule_and_argument_errors():
    indices, directions = TopKRule(1)(torch.tensor([0.5, -2.0]), torch.zeros(2, dtype=torch.int8))
    assert indices.tolist() == [1] and directions.tolist() == [1]
    for kwargs in ({"gamma": 0.0}, {"threshold": 0.0}, {"reset": 2.0}, {"cap": 0}):
        with pytest.raises(ValueError):
            BopRule([0, 2], **{"gamma": 0.1, "threshold": 0.1, **kwargs})
    rule = BopRule([0, 2], gamma=0.1, threshold=0.1)
    rule.set_progress(1.0, decay_to=0.1)
    assert rule.gamma_scale == pytest.approx(0.1)


def test_local_bop_runtime_alone_moves_exactly_like_bop_flip():
    """One rank, fp32 values: the momenta past the threshold are sent and move, as BopFlip moves them."""
    from lightning_hetero.sparseflip.runtime import SparseFlipRuntime
    from lightning_hetero.sparseflip.settings import CodeExchangeSettings, FlipSettings, SparseFlipSettings

    reference, model = _model(), _model()
    bop = BopFlip(reference, gamma=0.3, threshold=0.2, normalize=True, reset=0.0)
    settings = SparseFlipSettings(
        flip=FlipSettings(bop_gamma=0.3, bop_threshold=0.2),
        exchange=CodeExchangeSettings(encoding="fp32"),
        skip=(),
        trainable_scale=False,
    )
    runtime = SparseFlipRuntime(settings)
    runtime.setup(model, torch.device("cpu"))  # already converted: kept as it is
    moved = 0
    for step in range(6):
        _backward(reference, step)
        _backward(model, step)
        bop.step()
        bop.zero_grad()
        runtime.sync_gradients()
        moved += int(runtime.after_optimizer_step()["lowbit/flips"])
        assert torch.equal(CodeLayout(reference).flat_codes(), runtime.layout.flat_codes()), step
    assert moved > 0


@pytest.mark.parametrize(
    ("gamma", "threshold", "reset", "match"),
    [(0.0, 0.5, 0.0, "gamma must be in"), (0.1, 0.0, 0.0, "threshold must be > 0"), (0.1, 0.5, 2.0, "reset must be")],
)
def test_bop_flip_and_bop_rule_refuse_the_same_parameters_with_one_check(gamma, threshold, reset, match):
    from lightning_hetero.sparseflip.flip import check_bop_parameters

    for build in (
        lambda: check_bop_parameters(gamma, threshold, reset),
        lambda: BopRule([0, 4], gamma, threshold, reset),
        lambda: BopFlip(nn.ModuleList([LowBitLinear(4, 1, mode="flip")]), gamma, threshold, reset=reset),
    ):
        with pytest.raises(ValueError, match=match):
            build()
