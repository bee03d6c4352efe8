"""Dense export: a plain HF checkpoint with the constrained model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers

from lightning_hetero.subspace_pipeline import (
    SubspaceAdamW,
    SubspaceConfig,
    build_stages,
    constrained_model,
    dense_state_dict,
    export_dense,
    reference_forward,
)
from tests.unit.subspace_pipeline._tiny import chain_with_messages, fresh, relative_error, tiny_model, token_ids


def _trained_stages(model, config: SubspaceConfig, num_stages: int = 2, steps: int = 3):
    stages = build_stages(fresh(model), config, num_stages, list(range(num_stages)))
    params = [p for s in stages for p in s.parameters()]
    constrained = {p: a for s in stages for p, a in s.constrained_parameters().items()}
    optimizer = SubspaceAdamW(params, lr=1e-2, constrained=constrained)
    for _ in range(steps):
        optimizer.zero_grad()
        chain_with_messages(stages, token_ids(batch=4, seq=16))
        for stage in stages:
            stage.project_gradients_()
        optimizer.step()
    return stages


def _tokenizer() -> tf.PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("mode", ["reparam", "projected"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_export_loads_with_plain_transformers_and_equal_logits(tmp_path: Path, mode: str, num_stages: int) -> None:
    model = tiny_model()
    config = SubspaceConfig(subspace_dim=8, mode=mode)
    stages = _trained_stages(model, config, num_stages)
    # shuffled state dicts, as gathered from ranks
    states = [stage.state_dict() for stage in reversed(stages)]
    path = export_dense(states, model.config, tmp_path / "dense", tokenizer=_tokenizer(), subspace_config=config)
    loaded = tf.AutoModelForCausalLM.from_pretrained(path)
    assert type(loaded) is tf.LlamaForCausalLM and not loaded.config.tie_word_embeddings
    ids = token_ids()
    expected = reference_forward(stages, ids)
    assert relative_error(loaded(ids).logits, expected) < 1e-5
    assert tf.AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("w5") == 5
    assert relative_error(loaded(ids).logits, model(ids).logits) > 1e-2  # it is the trained constrained model


def test_export_of_the_whole_model_and_of_the_uncompressed_pipeline(tmp_path: Path) -> None:
    model = tiny_model(tie_word_embeddings=True)
    whole = constrained_model(fresh(model), SubspaceConfig(subspace_dim=8), 2)
    export_dense(whole, model.config, tmp_path / "whole")
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "whole")
    ids = token_ids()
    assert relative_error(loaded(ids).logits, reference_forward(whole, ids)) < 1e-5
    plain = build_stages(fresh(model), SubspaceConfig(compress=False), 2, [0, 1])
    export_dense(plain, model.config, tmp_path / "plain")
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_dense_state_dict_errors() -> None:
    model = tiny_model()
    config = SubspaceConfig(subspace_dim=8, seed=3)
    stages = build_stages(fresh(model), config, 2, [0, 1])
    with pytest.raises(ValueError, match="seed 3 differs"):
        dense_state_dict([s.state_dict() for s in stages], SubspaceConfig(subspace_dim=8, seed=4))
    other = build_stages(fresh(model), SubspaceConfig(subspace_dim=8, seed=5), 2, [1])[0]
    with pytest.raises(ValueError, match="different"):
        dense_state_dict([stages[0].state_dict(), other.state_dict()])
    with pytest.raises(ValueError, match="missing keys"):
        export_dense([stages[0]], model.config, "/nonexistent/never-written")
