"""AdamW parameter groups and the per-step warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_hetero.models import CausalLMModule, ImageClassifierModule
from lightning_hetero.models.optimization import WarmupCosineSchedule

LEARNING_RATE, WARMUP, TOTAL, MIN_RATIO = 1e-3, 10, 50, 0.1


def _bare_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, **kwargs
    )  # fmt: skip


def _optimizer_and_scheduler(module, trainer):
    module.configure_model()
    if trainer is not None:
        module.trainer = trainer
    configured = module.configure_optimizers()
    assert configured["lr_scheduler"]["interval"] == "step"
    return configured["optimizer"], configured["lr_scheduler"]["scheduler"]


def test_schedule_hits_analytic_values_at_start_peak_and_end() -> None:
    module = CausalLMModule(learning_rate=LEARNING_RATE, warmup_steps=WARMUP, min_lr_ratio=MIN_RATIO)
    optimizer, scheduler = _optimizer_and_scheduler(module, _bare_trainer(max_steps=TOTAL))
    seen = []
    for _ in range(TOTAL):
        seen.append(optimizer.param_groups[0]["lr"])  # the lr used by this step
        optimizer.step()  # no gradients: a no-op, only keeps the scheduler's call order valid
        scheduler.step()
    assert seen[0] == pytest.approx(LEARNING_RATE / (WARMUP + 1))
    assert seen[WARMUP] == pytest.approx(LEARNING_RATE)  # end of warmup = peak
    assert max(seen) == pytest.approx(LEARNING_RATE)
    assert seen[-1] == pytest.approx(MIN_RATIO * LEARNING_RATE)  # the last step is at the floor
    middle = WARMUP + (TOTAL - 1 - WARMUP) // 2
    progress = (middle - WARMUP) / (TOTAL - 1 - WARMUP)
    expected_middle = MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))
    assert seen[middle] == pytest.approx(LEARNING_RATE * expected_middle)
    assert all(a <= b for a, b in zip(seen[:WARMUP], seen[1 : WARMUP + 1], strict=True))  # warmup climbs
    assert all(a >= b for a, b in zip(seen[WARMUP:-1], seen[WARMUP + 1 :], strict=True))  # decay falls
    assert optimizer.param_groups[1]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])


def test_zero_warmup_starts_at_peak() -> None:
    schedule = WarmupCosineSchedule(warmup_steps=0, total_steps=5, min_lr_ratio=0.0)
    assert [round(schedule(step), 6) for step in range(5)] == [1.0, 0.853553, 0.5, 0.146447, 0.0]


@pytest.mark.parametrize("trainer_kwargs", [None, {"max_steps": -1, "max_epochs": -1}])
def test_unknown_length_keeps_lr_constant_after_warmup(trainer_kwargs: dict | None) -> None:
    module = CausalLMModule(learning_rate=LEARNING_RATE, warmup_steps=3)
    trainer = None if trainer_kwargs is None else _bare_trainer(**trainer_kwargs)
    with pytest.warns(UserWarning, match="unknown or infinite"):
        _, scheduler = _optimizer_and_scheduler(module, trainer)
    lambda_ = scheduler.lr_lambdas[0]
    assert lambda_.total_steps is None
    assert [lambda_(step) for step in (0, 3, 1_000_000)] == [0.25, 1.0, 1.0]


def test_warmup_longer_than_run_warns() -> None:
    module = CausalLMModule(warmup_steps=100)
    with pytest.warns(UserWarning, match="warmup_steps=100"):
        _optimizer_and_scheduler(module, _bare_trainer(max_steps=20))


def test_weight_decay_only_on_linear_matrices_of_llama() -> None:
    module = CausalLMModule(weight_decay=0.1, warmup_steps=WARMUP)
    optimizer, _ = _optimizer_and_scheduler(module, _bare_trainer(max_steps=TOTAL))
    decay, no_decay = optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"][1:])
    model = module.model
    assert any(p is model.lm_head.weight for p in decay["params"])  # untied head: a projection, decayed
    assert any(p is model.get_input_embeddings().weight for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_tied_gpt2_embedding_listed_once_without_decay() -> None:
    module = CausalLMModule(preset="gpt2-tiny", warmup_steps=WARMUP)
    optimizer, _ = _optimizer_and_scheduler(module, _bare_trainer(max_steps=TOTAL))
    decay, no_decay = optimizer.param_groups
    embedding = module.model.get_input_embeddings().weight
    assert module.model.lm_head.weight is embedding
    assert not any(p is embedding for p in decay["params"])
    assert sum(p is embedding for p in no_decay["params"]) == 1
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.model.parameters()))


def test_vit_class_token_and_position_embeddings_not_decayed() -> None:
    module = ImageClassifierModule(warmup_steps=WARMUP)
    optimizer, _ = _optimizer_and_scheduler(module, _bare_trainer(max_steps=TOTAL))
    decay, no_decay = optimizer.param_groups
    embeddings = module.model.vit.embeddings
    for parameter in (embeddings.cls_token, embeddings.position_embeddings):
        assert any(p is parameter for p in no_decay["params"])
    assert any(p is embeddings.patch_embeddings.projection.weight for p in decay["params"])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)
