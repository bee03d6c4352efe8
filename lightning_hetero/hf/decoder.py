"""Find a Llama-family HF causal LM inside a user's model and name its parts (decoder discovery).

Supported families (matched by class name anywhere in the MRO, found anywhere inside the module tree, e.g. a
LightningModule holding the model): ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``. They share the pre-norm layout ``model.{embed_tokens, layers, norm, rotary_emb}`` + ``lm_head``
with ``self_attn.o_proj`` and ``mlp.down_proj`` as the only residual-stream writers (:data:`RESIDUAL_WRITERS`); their
trainable norms sit on the sublayer *inputs* (and Qwen3's q/k norms inside attention). The subspace pipeline confines
those writers (``docs/subspace_pipeline.md``); greedy layerwise training recognises the same families. Framework-free:
torch (and the HF model handed in), never Lightning.
"""

from __future__ import annotations

import copy as copy_module
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "RESIDUAL_WRITERS",
    "SUPPORTED_FAMILIES",
    "DecoderParts",
    "find_decoder",
    "maybe_copy",
]

SUPPORTED_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
"""HF causal-LM class name -> family name."""

RESIDUAL_WRITERS = ("self_attn.o_proj", "mlp.down_proj")
"""Paths (inside a decoder layer) of the linear maps that write into the residual stream."""


@dataclass
class DecoderParts:
    """The pieces of an HF Llama-family causal LM that the stage modules are built from (references, not copies)."""

    causal_lm: nn.Module
    """The ``*ForCausalLM`` module."""
    path: str
    """Its FQN inside the module that was searched (``""`` when it is that module)."""
    family: str
    """``"llama"``, ``"mistral"``, ``"qwen2"`` or ``"qwen3"``."""
    config: Any
    """The HF config."""

    @property
    def base(self) -> nn.Module:
        """The base model (``causal_lm.model``)."""
        return self.causal_lm.model

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.base.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.base.layers

    @property
    def norm(self) -> nn.Module:
        return self.base.norm

    @property
    def rotary_emb(self) -> nn.Module:
        return self.base.rotary_emb

    @property
    def lm_head(self) -> nn.Linear:
        return self.causal_lm.lm_head

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.weight.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def tied(self) -> bool:
        """Whether the LM head shares the input embedding's weight (it is untied by the stage builder)."""
        return self.lm_head.weight is self.embed_tokens.weight


def _family_of(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        if cls.__name__ in SUPPORTED_FAMILIES:
            return SUPPORTED_FAMILIES[cls.__name__]
    return None


def find_decoder(model: nn.Module, writer_types: tuple[type[nn.Module], ...] = (nn.Linear,)) -> DecoderParts:
    """Locate the supported HF causal LM inside ``model`` (the model itself, or any submodule).

    Args:
        model: The model, or any module holding it.
        writer_types: What a residual writer (:data:`RESIDUAL_WRITERS`) may be: ``nn.Linear`` for a plain HF model;
            a caller that replaces the writers by its own modules adds their type.

    Raises:
        ValueError: no supported family found (the message names the supported classes and what was found instead),
            or the model lacks the expected layout.
    """
    for path, module in model.named_modules():
        family = _family_of(module)
        if family is None:
            continue
        parts = DecoderParts(causal_lm=module, path=path, family=family, config=module.config)
        missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(parts.base, name)]
        if missing or not hasattr(module, "lm_head"):
            raise ValueError(
                f"{type(module).__name__} at {path or '<root>'!r} lacks {missing or ['lm_head']}; it does "
                "not have the standard HF decoder layout."
            )
        for index, layer in enumerate(parts.layers):
            for writer in RESIDUAL_WRITERS:
                if not isinstance(layer.get_submodule(writer), writer_types):
                    raise ValueError(f"layer {index} of {type(module).__name__} has no nn.Linear at {writer!r}.")
        return parts
    found = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if type(m).__name__.endswith(("Model", "LMHeadModel")) or "For" in type(m).__name__
        }
    )
    raise ValueError(
        f"no supported Hugging Face causal LM found in {type(model).__name__}"
        f"{' (found: ' + ', '.join(found) + ')' if found else ''}. It supports "
        f"{', '.join(SUPPORTED_FAMILIES)} (pre-norm decoders whose residual writers are o_proj and down_proj)."
    )


def maybe_copy(module: nn.Module, copy: bool) -> nn.Module:
    """``copy.deepcopy(module)`` when ``copy`` else the module itself."""
    return copy_module.deepcopy(module) if copy else module
