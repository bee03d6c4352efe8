"""The block split: the stack computes exactly the model's logits, splits are validated, aux heads fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hetero.layerwise import split_into_blocks
from tests.unit.layerwise.helpers import tiny_batch, tiny_model

FAMILIES = ("vit", "llama", "gpt2", "cnn")


def _model_logits(model: nn.Module, family: str, batch: dict) -> torch.Tensor:
    if family == "cnn":
        return model(batch["pixel_values"])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split", [{}, {"num_blocks": 2}, {"boundaries": [1]}])
def test_stack_forward_equals_model_logits(family, split, device):
    torch.manual_seed(0)
    model = tiny_model(family).eval().to(device)
    stack = split_into_blocks(model, **split)
    batch = {key: value.to(device) for key, value in tiny_batch(family).items()}
    with torch.no_grad():
        assert torch.equal(stack(batch), _model_logits(model, family, batch))
    expected_blocks = {"": 3, "num_blocks": 2, "boundaries": 2}[next(iter(split), "")]
    assert stack.num_blocks == expected_blocks
    assert stack.task == ("causal_lm" if family in ("llama", "gpt2") else "classification")


def test_blocks_reference_the_models_own_modules():
    model = tiny_model("llama")
    stack = split_into_blocks(model, boundaries=[2])
    assert stack.unit_ranges == [(0, 2), (2, 3)]
    assert stack.blocks[1].units[0] is model.model.layers[2]
    assert stack.stem is model.model.embed_tokens
    assert stack.signature == "llama:3:0-2,2-3"


def test_found_inside_a_wrapper_module():
    wrapper = nn.Module()
    wrapper.model = tiny_model("vit")
    assert split_into_blocks(wrapper).family == "vit"


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ({"num_blocks": 4}, "num_blocks=4 does not fit the model's 3 layers"),
        ({"num_blocks": 0}, "use 1..3"),
        ({"boundaries": [0, 2]}, "strictly increasing layer indices in 1..2"),
        ({"boundaries": [2, 1]}, "strictly increasing"),
        ({"boundaries": [3]}, "do not fit the model's 3 layers"),
        ({"num_blocks": 2, "boundaries": [1]}, "not both"),
    ],
)
def test_split_that_does_not_fit_is_rejected(split, message):
    with pytest.raises(ValueError, match=message):
        split_into_blocks(tiny_model("gpt2"), **split)


def test_unsupported_model_is_rejected_with_the_supported_list():
    with pytest.raises(ValueError, match="ViTForImageClassification, GPT2LMHeadModel"):
        split_into_blocks(nn.Linear(3, 3))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["linear", "mlp", "lm_head"])
def test_aux_heads_map_every_block_to_logits(family, kind):
    model = tiny_model(family)
    stack = split_into_blocks(model)
    batch = tiny_batch(family)
    if kind == "lm_head" and stack.task != "causal_lm":
        with pytest.raises(ValueError, match="needs a causal LM"):
            stack.make_aux_head(kind)
        return
    context, hidden = stack.context_of(batch), stack.embed(batch)
    for index, block in enumerate(stack.blocks):
        hidden = block(hidden, context)
        logits = stack.make_aux_head(kind, block_index=index)(hidden)
        expected = (4, 10) if stack.task == "classification" else (4, 12, 64)
        assert logits.shape == expected


def test_lm_head_aux_is_tied_to_the_embedding():
    stack = split_into_blocks(tiny_model("llama"))
    head = stack.make_aux_head("lm_head")
    assert not any(p is stack.stem.weight for p in head.parameters())  # not registered twice ...
    hidden = torch.randn(2, 5, 32)
    expected = head.norm(hidden) @ stack.stem.weight.T  # ... but read at every call
    assert torch.equal(head(hidden), expected)


def test_aux_head_bad_arguments():
    stack = split_into_blocks(tiny_model("vit"))
    with pytest.raises(ValueError, match="is not one of"):
        stack.make_aux_head("conv")
    with pytest.raises(ValueError, match="num_outputs=0 must be >= 1"):
        stack.make_aux_head("linear", 0)
    llama = split_into_blocks(tiny_model("llama"))
    with pytest.raises(ValueError, match="predicts the 64-token vocabulary"):
        llama.make_aux_head("lm_head", 10)


def test_cnn_needs_a_flatten_and_a_conv():
    with pytest.raises(ValueError, match="nn.Flatten"):
        split_into_blocks(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="no conv layer"):
        split_into_blocks(nn.Sequential(nn.Linear(2, 2), nn.Flatten(), nn.Linear(2, 2)))


def test_cnn_blocks_record_their_widths():
    stack = split_into_blocks(tiny_model("cnn"), boundaries=[2])
    assert stack.block_channels == [8, 8]
    assert stack.signature == "cnn:3:0-2,2-3"


@pytest.mark.parametrize("family", FAMILIES)
def test_block_input_shape_is_inferred_without_running_the_model(family):
    """What a pipeline stage expects from its peer: the real per-sample shapes, from shapes alone (meta device)."""
    torch.manual_seed(0)
    model = tiny_model(family).eval()
    stack = split_into_blocks(model)
    batch = tiny_batch(family)
    real = []
    with torch.no_grad():
        hidden, context = stack.embed(batch), stack.context_of(batch)
        for block in stack.blocks:
            real.append(tuple(hidden.shape[1:]))
            hidden = block(hidden, context)
    assert [stack.block_input_shape(j, batch) for j in range(stack.num_blocks)] == real
    assert all(p.device.type == "cpu" for p in model.parameters())  # inferred on copies, the model stays put
