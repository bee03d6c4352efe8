"""Split a model into a stem, a stack of blocks and a final head, for greedy (and decoupled) layerwise training.

:func:`split_into_blocks` ``(model, num_blocks=None, boundaries=None) -> BlockStack`` works on (found anywhere inside
``model``, e.g. a LightningModule holding it):

- HF ViT (``ViTForImageClassification``): stem = patch/position embeddings, units = encoder layers, final head =
  final LayerNorm + classifier on the [CLS] token; ``task == "classification"``.
- HF Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2/3ForCausalLM``): stem = token embedding,
  units = decoder layers (called with rotary embeddings and the causal mask, as HF's model forward calls them), final
  head = final norm + LM head; ``task == "causal_lm"``.
- HF GPT-2 (``GPT2LMHeadModel``): stem = token + position embeddings (+ dropout), units = transformer blocks, final
  head = ``ln_f`` + LM head (tied to the token embedding); ``task == "causal_lm"``.
- A CNN given as ``nn.Sequential``: units start at every module with a 4-D ``weight`` (a conv, also a low-bit conv);
  the final head is everything from the first ``nn.Flatten`` on; the stem is the identity (the first block owns the
  first conv); ``task == "classification"``.

``num_blocks`` groups the units into that many balanced contiguous blocks; ``boundaries`` gives the unit indices at
which blocks 1.. start (``[2]`` on 4 layers: blocks ``[0, 2)`` and ``[2, 4)``); neither: one block per unit.

The result is a :class:`~lightning_hetero.layerwise.stack.BlockStack` (see :mod:`lightning_hetero.layerwise.stack`
for what it offers). The Llama family is recognised by :data:`lightning_hetero.hf.decoder.SUPPORTED_FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_hetero.hf.decoder import SUPPORTED_FAMILIES as LLAMA_FAMILIES
from lightning_hetero.layerwise.stack import BlockStack, GPT2Stem, NormAndProject
from lightning_hetero.pipeline.layout import split_layers

__all__ = ["split_into_blocks"]


def _class_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def _ranges(
    num_units: int, num_blocks: int | None, boundaries: Sequence[int] | None, what: str
) -> list[tuple[int, int]]:
    if num_blocks is not None and boundaries is not None:
        raise ValueError("pass num_blocks or boundaries, not both.")
    if boundaries is not None:
        points = list(boundaries)
        if any(isinstance(p, bool) or not isinstance(p, int) for p in points):
            raise ValueError(f"boundaries={points!r} must be integers ({what} indices at which blocks 1.. start).")
        if points != sorted(set(points)) or (points and (points[0] <= 0 or points[-1] >= num_units)):
            raise ValueError(
                f"boundaries={points!r} do not fit the model's {num_units} {what}s: they must be strictly increasing "
                f"{what} indices in 1..{num_units - 1} (each block needs at least one {what})."
            )
        edges = [0, *points, num_units]
        return list(zip(edges[:-1], edges[1:], strict=True))
    if num_blocks is None:
        num_blocks = num_units
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 1 <= num_blocks <= num_units:
        raise ValueError(
            f"num_blocks={num_blocks!r} does not fit the model's {num_units} {what}s: use 1..{num_units} "
            f"(every block needs at least one {what})."
        )
    return split_layers(num_units, num_blocks)


def _find_hf(model: nn.Module) -> tuple[str, nn.Module] | None:
    for module in model.modules():
        names = _class_names(module)
        if "ViTForImageClassification" in names:
            return "vit", module
        if "GPT2LMHeadModel" in names:
            return "gpt2", module
        if names & set(LLAMA_FAMILIES):
            return "llama", module
    return None


def _split_cnn(model: nn.Sequential, num_blocks: int | None, boundaries: Sequence[int] | None) -> BlockStack:
    children = list(model)
    flatten = next((i for i, m in enumerate(children) if isinstance(m, nn.Flatten)), None)
    if flatten is None:
        raise ValueError("a CNN (nn.Sequential) needs an nn.Flatten before its classifier: the head starts there.")
    starts = [
        i for i, m in enumerate(children[:flatten]) if getattr(m, "weight", None) is not None and m.weight.ndim == 4
    ]
    if not starts:
        raise ValueError("the nn.Sequential has no conv layer (no module with a 4-D weight) before its nn.Flatten.")
    starts[0] = 0  # anything before the first conv belongs to the first stage
    stages = [nn.Sequential(*children[a:b]) for a, b in zip(starts, [*starts[1:], flatten], strict=True)]
    channels = [next(m.weight.shape[0] for m in reversed(list(stage)) if getattr(m, "weight", None) is not None
                     and m.weight.ndim == 4) for stage in stages]  # fmt: skip
    ranges = _ranges(len(stages), num_blocks, boundaries, "conv stage")
    head = nn.Sequential(*children[flatten:])
    outputs = next(m.out_features for m in reversed(children) if hasattr(m, "out_features"))
    return BlockStack(
        family="cnn", task="classification", root=model, stem=nn.Identity(), units=stages, unit_ranges=ranges,
        final_head=head, hidden_size=channels[-1], num_outputs=outputs,
        block_channels=[channels[b - 1] for _, b in ranges],
    )  # fmt: skip


def split_into_blocks(
    model: nn.Module, num_blocks: int | None = None, boundaries: Sequence[int] | None = None
) -> BlockStack:
    """Cut ``model`` (or the supported model inside it) into a :class:`BlockStack`; see the module docstring.

    Raises:
        ValueError: no supported model inside ``model``, or a split that does not fit it (the message says which
            values would).
    """
    found = _find_hf(model)
    if found is None:
        sequential = model if isinstance(model, nn.Sequential) else None
        if sequential is None:
            candidates = [m for m in model.modules() if isinstance(m, nn.Sequential) and any(
                isinstance(c, nn.Flatten) for c in m)]  # fmt: skip
            sequential = candidates[0] if candidates else None
        if sequential is None:
            raise ValueError(
                f"split_into_blocks found no supported model in {type(model).__name__}: it splits HF "
                f"ViTForImageClassification, GPT2LMHeadModel, {', '.join(LLAMA_FAMILIES)}, or a CNN given as an "
                f"nn.Sequential of conv stages followed by nn.Flatten and a classifier."
            )
        return _split_cnn(sequential, num_blocks, boundaries)
    family, root = found
    config = root.config
    if family == "vit":
        base = root.vit
        units = list(base.layers)
        ranges = _ranges(len(units), num_blocks, boundaries, "layer")
        head = NormAndProject(base.layernorm, root.classifier, cls_token=True)
        return BlockStack(
            family=family, task="classification", root=root, stem=base.embeddings, units=units, unit_ranges=ranges,
            final_head=head, hidden_size=config.hidden_size, num_outputs=root.classifier.out_features,
        )  # fmt: skip
    if family == "gpt2":
        transformer = root.transformer
        units = list(transformer.h)
        stem: nn.Module = GPT2Stem(transformer)
        norm = transformer.ln_f
    else:
        units = list(root.model.layers)
        stem = root.model.embed_tokens
        norm = root.model.norm
    ranges = _ranges(len(units), num_blocks, boundaries, "layer")
    head = NormAndProject(norm, root.lm_head)
    return BlockStack(
        family=family, task="causal_lm", root=root, stem=stem, units=units, unit_ranges=ranges, final_head=head,
        hidden_size=root.lm_head.in_features, num_outputs=root.lm_head.out_features,
    )  # fmt: skip
