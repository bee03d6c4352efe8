"""Tiny HF decoders (d=64, 4 layers, vocab 128) with non-trivial random weights, and helpers shared by the tests."""

from __future__ import annotations

import copy

import torch
import transformers as tf
from torch import Tensor, nn

from lightning_hetero.subspace_pipeline import StageModule

VOCAB, D, LAYERS = 128, 64, 4
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": D,
    "intermediate_size": 96,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
}
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 8}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
}


def tiny_model(family: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> nn.Module:
    """A tiny causal LM with std-0.1 weights and perturbed norm gains (so that every piece matters), in eval mode."""
    config_class, model_class, extra = FAMILIES[family]
    config = config_class(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0, 0.1)
    return model.to(dtype).eval()


def token_ids(batch: int = 2, seq: int = 12, seed: int = 1) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, seq), generator=generator)


def fresh(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    return float((actual.detach() - expected.detach()).norm() / expected.detach().norm())


def chain_with_messages(stages: list[StageModule], input_ids: Tensor, labels: Tensor | None = None):
    """Run stages as a pipeline would: each boundary tensor is detached and re-leafed, the loss's backward goes stage
    by stage through the received tensors' gradients. Returns (logits, loss, [boundary inputs with .grad])."""
    from lightning_hetero.subspace_pipeline import causal_lm_loss

    received: list[Tensor] = []
    outputs: list[Tensor] = []
    x = None
    for stage in stages:
        out = stage(x, input_ids)
        outputs.append(out)
        if not stage.is_last:
            x = out.detach().requires_grad_(True)
            received.append(x)
    logits = outputs[-1]
    loss = causal_lm_loss(logits, input_ids if labels is None else labels)
    loss.backward()
    for index in range(len(stages) - 2, -1, -1):
        outputs[index].backward(received[index].grad)
    return logits, loss, received
