"""The DGL export, in one process: every stage of a pipeline built from copies of one module, then joined and written.

The spawned end-to-end version (Trainer, 2 gloo ranks, ``export_dir``) is in ``tests/usercode/test_layerwise_user.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageClassification

from lightning_hetero.layerwise.dgl_stage import build_dgl_stage
from lightning_hetero.layerwise.export import (
    STATE_FILE,
    export_bytes_limit,
    merge_stage_states,
    save_model,
    stage_export_state,
)
from tests.unit.layerwise.helpers import tiny_batch, tiny_model


class _Holder(nn.Module):
    def __init__(self, family: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = tiny_model(family)


def _pipeline(family: str, num_stages: int) -> list[tuple]:
    """``num_stages`` stages cut from copies of one module, each 'trained' (perturbed) differently."""
    original = _Holder(family)
    stages = []
    for stage in range(num_stages):
        holder = copy.deepcopy(original)
        stack, container = build_dgl_stage(holder, num_stages, stage, None, "linear", None, torch.device("cpu"))
        with torch.no_grad():
            for index, parameter in enumerate(container.parameters()):
                parameter.add_(0.01 * (stage + 1) * (index % 3 + 1))  # untied copies drift apart, as in training
        stages.append((stack, container))
    return stages


@torch.no_grad()
def _pipeline_logits(stages: list[tuple], batch: dict) -> torch.Tensor:
    hidden = None
    for stack, container in stages:
        container.eval()
        hidden = stack.embed(batch) if hidden is None else hidden
        hidden = container.block(hidden, stack.context_of(batch))
    return stages[-1][1].head(hidden)


@pytest.mark.parametrize("family", ["llama", "gpt2", "vit"])
def test_exported_hf_model_loads_and_gives_the_pipelines_logits(tmp_path, family: str) -> None:
    stages = _pipeline(family, 3)
    root = stages[0][0].root
    merged = merge_stage_states([stage_export_state(stack.root) for stack, _ in stages], root)
    save_model(root, merged, tmp_path, untie=True)
    auto = AutoModelForImageClassification if family == "vit" else AutoModelForCausalLM
    exported = auto.from_pretrained(tmp_path).eval()
    batch = tiny_batch(family)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    expected = _pipeline_logits(stages, batch)
    got = exported(**inputs).logits
    if family != "vit":  # padding: only the positions the mask keeps are defined the same way
        keep = batch["attention_mask"].bool()
        expected, got = expected[keep], got[keep]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_cnn_export_is_the_sequentials_state_dict(tmp_path) -> None:
    stages = _pipeline("cnn", 3)
    root = stages[0][0].root
    save_model(root, merge_stage_states([stage_export_state(stack.root) for stack, _ in stages], root), tmp_path)
    model = tiny_model("cnn").eval()
    model.load_state_dict(torch.load(tmp_path / STATE_FILE, weights_only=True))
    batch = tiny_batch("cnn")
    torch.testing.assert_close(model(batch["pixel_values"]), _pipeline_logits(stages, batch))


def test_a_missing_stage_is_refused(tmp_path) -> None:
    stages = _pipeline("llama", 3)
    root = stages[0][0].root
    with pytest.raises(ValueError, match="no stage holds"):
        merge_stage_states([stage_export_state(stack.root) for stack, _ in stages[:2]], root)


@pytest.mark.parametrize("family", ["llama", "gpt2", "vit", "cnn"])
def test_every_stage_share_fits_the_bound_rank_0_puts_on_it(family: str) -> None:
    from safetensors.torch import save

    stages = _pipeline(family, 3)
    whole = sum(v.numel() * v.element_size() for v in _Holder(family).model.state_dict().values())
    for stack, _ in stages:
        limit = export_bytes_limit(stack.root)  # what each stage's rank computes from its hollow model
        share = len(save({k: v.contiguous() for k, v in stage_export_state(stack.root).items()}))
        assert share <= limit < whole + (2 << 20)  # the whole model's size, not a machine's memory
