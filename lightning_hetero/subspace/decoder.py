"""Find the HF decoder inside a user's model, split its layers into stages and confine its residual writers.

Supported families (matched by class name anywhere in the MRO, found anywhere inside the module tree, e.g. a
LightningModule holding the model): ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``. They share the pre-norm layout ``model.{embed_tokens, layers, norm, rotary_emb}`` + ``lm_head``
with ``self_attn.o_proj`` and ``mlp.down_proj`` as the only residual-stream writers; their trainable norms sit on the
sublayer *inputs* (and Qwen3's q/k norms inside attention), so confining those two writers and the embedding is
enough (see ``docs/subspace.md``).
"""

from __future__ import annotations

import copy as copy_module
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_hetero.subspace.basis import SubspaceBasis
from lightning_hetero.subspace.layers import ProjectedLinear, SubspaceLinear

__all__ = [
    "RESIDUAL_WRITERS",
    "SUPPORTED_FAMILIES",
    "DecoderParts",
    "constrain_layer_",
    "find_decoder",
    "maybe_copy",
    "split_layers",
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


def find_decoder(model: nn.Module) -> DecoderParts:
    """Locate the supported HF causal LM inside ``model`` (the model itself, or any submodule).

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
                f"not have the standard HF decoder layout this strategy splits."
            )
        for index, layer in enumerate(parts.layers):
            for writer in RESIDUAL_WRITERS:
                if not isinstance(layer.get_submodule(writer), nn.Linear | SubspaceLinear):
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
        f"{' (found: ' + ', '.join(found) + ')' if found else ''}. The subspace pipeline supports "
        f"{', '.join(SUPPORTED_FAMILIES)} (pre-norm decoders whose residual writers are o_proj and down_proj)."
    )


def constrain_layer_(layer: nn.Module, owner: SubspaceBasis, mode: str) -> None:
    """Replace a decoder layer's ``o_proj`` and ``down_proj`` by their confined versions, in place.

    ``reparam``: :class:`SubspaceLinear` with ``Z = U^T W``; ``projected``: :class:`ProjectedLinear` sharing the
    original parameters, projected onto span(U). Either way the layer computes ``U U^T W`` afterwards.
    """
    for writer in RESIDUAL_WRITERS:
        parent_path, name = writer.rsplit(".", 1)
        parent = layer.get_submodule(parent_path)
        linear = getattr(parent, name)
        if isinstance(linear, SubspaceLinear | ProjectedLinear):
            raise ValueError(
                f"{writer} is already confined; build the stages from an unmodified HF model (or pass copy=True)."
            )
        confined = (
            SubspaceLinear.from_linear(linear, owner)
            if mode == "reparam"
            else ProjectedLinear.from_linear(linear, owner)
        )
        setattr(parent, name, confined)


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Balanced contiguous ``[start, stop)`` layer ranges, earlier stages taking the remainder.

    Raises:
        ValueError: ``num_stages`` < 1 or > ``num_layers``.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be a positive integer.")
    if num_stages > num_layers:
        raise ValueError(
            f"num_stages={num_stages} exceeds the model's {num_layers} decoder layers; every stage needs at least "
            f"one layer, so use num_stages <= {num_layers}."
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        stop = start + base + (1 if stage < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def maybe_copy(module: nn.Module, copy: bool) -> nn.Module:
    """``copy.deepcopy(module)`` when ``copy`` else the module itself."""
    return copy_module.deepcopy(module) if copy else module
