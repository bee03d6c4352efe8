"""The low-bit classifier experiment of recipes/sparseflip/lowbit_experiments.py (a short smoke run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "recipes" / "sparseflip"))

from lowbit_experiments import FlipSettings, train_classifier  # noqa: E402


def test_train_classifier_smoke_and_determinism() -> None:
    settings = FlipSettings(gamma=0.1, threshold=0.2)
    first = train_classifier("mlp", "digits", "flip_ternary", steps=20, seed=3, flip=settings)
    second = train_classifier("mlp", "digits", "flip_ternary", steps=20, seed=3, flip=settings)
    assert first["accuracy"] == second["accuracy"] and first["flips"] == second["flips"] > 0
    assert 0.0 <= first["accuracy"] <= 1.0 and first["train_seconds"] >= 0
    # codes 64*128 + 128*10 (1 byte), fp params: biases 138 + row scales 138 (4 + 8 bytes), Bop fp16 state 2 bytes
    codes, fp = 64 * 128 + 128 * 10, 138 + 138
    assert first["weight_bytes"] == codes + 4 * fp and first["optimizer_bytes"] == 8 * fp + 2 * codes
    assert first["fp32_adamw_bytes"] == 12 * (codes + 138)
    assert first["settings"]["optimizer"] == "bop" and first["settings"]["state_dtype"] == "torch.float16"
    dense = train_classifier("mlp", "digits", "fp32", steps=5, seed=3)
    assert dense["total_bytes"] == dense["fp32_adamw_bytes"] and dense["flips"] == 0
    with pytest.raises(ValueError, match="method"):
        train_classifier(method="int4")
