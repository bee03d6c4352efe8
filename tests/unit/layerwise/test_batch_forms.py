"""Layerwise training takes a plain LightningModule's ``(x, y)`` batches as well as HF-style dicts."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.layerwise import GreedyStages, split_into_blocks
from tests.unit.layerwise.helpers import tiny_batch, tiny_model


@pytest.mark.parametrize("family", ["cnn", "llama"])
def test_a_pair_gives_the_same_stage_loss_as_the_dict(family: str) -> None:
    torch.manual_seed(0)
    stages = GreedyStages(split_into_blocks(tiny_model(family), num_blocks=3))
    batch = tiny_batch(family)
    inputs = batch["pixel_values"] if family == "cnn" else batch["input_ids"]
    for stage in range(3):
        stages.enter_stage(stage)
        assert torch.equal(stages.stage_loss((inputs, batch["labels"])), stages.stage_loss(batch))
        assert torch.equal(stages.stage_loss([inputs, batch["labels"]]), stages.stage_loss(batch))


@pytest.mark.parametrize("batch", [(torch.zeros(2, 1, 28, 28),), "images", (torch.zeros(2), torch.zeros(2), 3)])
def test_other_batches_are_refused_naming_what_is_read(batch: object) -> None:
    stack = split_into_blocks(tiny_model("cnn"))
    with pytest.raises(ValueError, match=r"'pixel_values' and 'labels'.*\(inputs, labels\) pair"):
        stack.as_batch(batch)
