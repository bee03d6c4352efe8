"""The :class:`BlockStack`: a model cut into a stem, blocks and a final head (built by
:func:`lightning_hetero.layerwise.blocks.split_into_blocks`), and the small modules it is made of.

A :class:`BlockStack` holds *references* to the model's own modules (nothing is copied, so training a block trains
the model):

- ``stack.as_batch(batch)``: a batch as the dict the other methods read (an ``(inputs, labels)`` pair becomes
  ``{"pixel_values" | "input_ids": inputs, "labels": labels}``).
- ``stack.embed(batch) -> hidden``: the stem on a batch dict (``pixel_values`` for images; ``input_ids`` for text);
  ``stack.stem`` is the module that owns the stem's parameters.
- ``stack.blocks``: ``nn.ModuleList``; ``stack.blocks[j](hidden, context) -> hidden``.
- ``stack.context_of(batch) -> dict``: what every block needs besides the hidden state (causal masks, rotary
  ``position_embeddings``, ``position_ids``), rebuilt from the batch alone, so any worker holding any block can make it.
- ``stack.final_head(hidden) -> logits`` (``[B, classes]`` or ``[B, T, vocab]``); ``stack.loss(logits, batch)``:
  cross-entropy with ``labels`` (causal LM: shifted, ``-100`` ignored, as HF computes it).
- ``stack.make_aux_head(kind, num_outputs=None, block_index=-1)``: a fresh auxiliary head for block ``j``'s output:
  ``"linear"``, ``"mlp"`` (one hidden layer) or, for causal LMs, ``"lm_head"`` (a copy of the final norm + a
  projection tied to the input embedding weight). ``num_outputs`` defaults to the model's classes / vocabulary.
- ``stack.forward(batch)``: the whole model through the stack (equals the HF model's logits).
- ``stack.hidden_size``, ``stack.task``, ``stack.family``, ``stack.unit_ranges`` (``[start, stop)`` unit indices per
  block), ``stack.signature`` (a string that changes whenever the split does; stored in checkpoints).

Nothing here imports Lightning.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["AUX_HEAD_KINDS", "BlockStack", "GPT2Stem", "NormAndProject", "Segment", "TiedProjection"]

AUX_HEAD_KINDS: tuple[str, ...] = ("linear", "mlp", "lm_head")
"""Kinds of :meth:`BlockStack.make_aux_head` (``"lm_head"``: causal LMs only)."""

_IGNORE_INDEX = -100


def _first_output(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


class Segment(nn.Module):
    """A contiguous run of units (layers) of one family, called the way the family's model forward calls them."""

    def __init__(self, family: str, units: Sequence[nn.Module]) -> None:
        super().__init__()
        self.family = family
        self.units = nn.ModuleList(units)

    def forward(self, hidden: Tensor, context: Mapping[str, Any] | None = None) -> Tensor:
        context = context or {}
        for unit in self.units:
            if self.family == "vit":
                hidden = _first_output(unit(hidden, context.get("attention_mask")))
            elif self.family == "gpt2":
                hidden = _first_output(
                    unit(hidden, None, context.get("attention_mask"), position_ids=context.get("position_ids"))
                )
            elif self.family == "llama":
                hidden = _first_output(
                    unit(
                        hidden,
                        attention_mask=context["masks"][context["layer_types"][id(unit)]],
                        position_embeddings=context["position_embeddings"],
                        position_ids=context["position_ids"],
                    )
                )
            else:
                hidden = unit(hidden)
        return hidden


class GPT2Stem(nn.Module):
    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class NormAndProject(nn.Module):
    """``proj(norm(h))``; with ``cls_token`` only the first position (ViT's classifier input)."""

    def __init__(self, norm: nn.Module, proj: nn.Module, cls_token: bool = False) -> None:
        super().__init__()
        self.norm, self.proj, self.cls_token = norm, proj, cls_token

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = self.norm(hidden)
        return self.proj(hidden[:, 0] if self.cls_token else hidden)


class TiedProjection(nn.Module):
    """``h @ E^T`` with the input embedding's weight ``E`` (shared, not copied: it trains only with the stem)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self._embedding = [embedding]  # a list, so the embedding is not registered twice in state dicts

    def forward(self, hidden: Tensor) -> Tensor:
        return nn.functional.linear(hidden, self._embedding[0].weight)


def _mlp(in_features: int, hidden: int, out_features: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))


class BlockStack:
    """A model cut into ``stem``, ``blocks`` and ``final_head`` (see the module docstring). Build it with
    :func:`split_into_blocks`."""

    def __init__(
        self,
        *,
        family: str,
        task: str,
        root: nn.Module,
        stem: nn.Module,
        units: Sequence[nn.Module],
        unit_ranges: Sequence[tuple[int, int]],
        final_head: nn.Module,
        hidden_size: int,
        num_outputs: int,
        block_channels: Sequence[int] | None = None,
    ) -> None:
        self.family, self.task, self.root, self.stem, self.final_head = family, task, root, stem, final_head
        self.unit_ranges = [tuple(r) for r in unit_ranges]
        self.num_units = len(units)
        self.blocks = nn.ModuleList([Segment(family, units[a:b]) for a, b in self.unit_ranges])
        self.hidden_size = hidden_size
        self.num_outputs = num_outputs
        self.block_channels = list(block_channels) if block_channels is not None else [hidden_size] * len(self.blocks)

    # ------------------------------------------------------------------------------------------------ description
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def signature(self) -> str:
        """``family:units:ranges`` (e.g. ``vit:4:0-2,2-4``); resuming under another split compares these."""
        ranges = ",".join(f"{a}-{b}" for a, b in self.unit_ranges)
        return f"{self.family}:{self.num_units}:{ranges}"

    @property
    def device(self) -> torch.device:
        return next(self.blocks.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(p for p in self.blocks.parameters() if p.is_floating_point()).dtype

    # ------------------------------------------------------------------------------------------------ forward
    def as_batch(self, batch: Any) -> Mapping[str, Any]:
        """``batch`` as the dict the stack reads: a mapping as it is; an ``(inputs, labels)`` pair (a plain
        LightningModule's ``(x, y)``) as ``{"pixel_values": x, "labels": y}`` (``"input_ids"`` for a causal LM).

        Raises:
            ValueError: anything else, naming what the stack reads.
        """
        if isinstance(batch, Mapping):
            return batch
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(v, Tensor) for v in batch):
            key = "pixel_values" if self.task == "classification" else "input_ids"
            return {key: batch[0], "labels": batch[1]}
        kind = type(batch).__name__ + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        key = "pixel_values" if self.task == "classification" else "input_ids"
        raise ValueError(
            f"layerwise training reads a batch as a dict ({key!r} and 'labels', as HF models take them) or an "
            f"(inputs, labels) pair of tensors, but got a {kind}. Make the data loader yield one of these."
        )

    def model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Tensor]:
        """The entries of ``batch`` the stem and :meth:`context_of` read (also what a content cache key hashes)."""
        keys = ("pixel_values",) if self.task == "classification" else ("input_ids", "attention_mask")
        if keys[0] not in batch:
            raise KeyError(
                f"the {self.family} block stack reads batch[{keys[0]!r}], but the batch has keys {sorted(batch)}."
            )
        return {key: batch[key] for key in keys if batch.get(key) is not None}

    def embed(self, batch: Mapping[str, Any]) -> Tensor:
        """The stem's output for a batch dict."""
        inputs = self.model_inputs(batch)
        if self.task == "classification":
            pixels = inputs["pixel_values"]
            return self.stem(pixels.to(self.dtype) if pixels.is_floating_point() else pixels)
        return self.stem(inputs["input_ids"])

    def context_of(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """What blocks need besides the hidden state, from the batch alone (empty for ViT without padding / CNN)."""
        if self.family in ("cnn", "vit"):
            return {}
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        inputs = self.model_inputs(batch)
        input_ids = inputs["input_ids"]
        attention_mask = inputs.get("attention_mask")
        batch_size, seq = input_ids.shape
        probe = torch.empty(batch_size, seq, 1, dtype=self.dtype, device=input_ids.device)  # shape/dtype/device only
        position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0)
        config = self.root.config
        kwargs = {"config": config, "inputs_embeds": probe, "attention_mask": attention_mask, "cache": None}
        if self.family == "gpt2":
            return {
                "attention_mask": create_causal_mask(position_ids=position_ids, **kwargs),
                "position_ids": position_ids,
            }
        layer_types = {id(u): t for u, t in zip(self.root.model.layers, _llama_layer_types(config), strict=False)}
        masks: dict[str, Any] = {}
        if "full_attention" in layer_types.values():
            masks["full_attention"] = create_causal_mask(position_ids=position_ids, **kwargs)
        if "sliding_attention" in layer_types.values():
            masks["sliding_attention"] = create_sliding_window_causal_mask(position_ids=position_ids, **kwargs)
        rotary = self.root.model.rotary_emb(probe, position_ids)
        return {"masks": masks, "layer_types": layer_types, "position_embeddings": rotary, "position_ids": position_ids}

    def forward(self, batch: Mapping[str, Any]) -> Tensor:
        """Logits of the whole model through the stack (as the model's own forward computes them)."""
        context = self.context_of(batch)
        hidden = self.embed(batch)
        for block in self.blocks:
            hidden = block(hidden, context)
        return self.final_head(hidden)

    __call__ = forward

    def block_input_shape(self, block_index: int, batch: Mapping[str, Any]) -> tuple[int, ...]:
        """Per-sample shape of what block ``block_index`` receives for ``batch``, known without running the model.

        Text models: ``(sequence, hidden_size)``. Images: the stem and the blocks before ``block_index`` run on the
        meta device (shapes only; modules not already on it are copied there first). A pipeline stage compares what
        a peer announces with this before it allocates anything.
        """
        if self.task == "causal_lm":
            return (int(self.model_inputs(batch)["input_ids"].shape[1]), int(self.hidden_size))
        pixels = self.model_inputs(batch)["pixel_values"]
        dtype = self.dtype if pixels.is_floating_point() else pixels.dtype
        with torch.no_grad():
            hidden = _on_meta(self.stem)(torch.empty(pixels.shape, dtype=dtype, device="meta"))
            for block in self.blocks[:block_index]:
                hidden = _on_meta(block)(hidden, {})
        return tuple(int(d) for d in hidden.shape[1:])

    def loss(self, logits: Tensor, batch: Mapping[str, Any]) -> Tensor:
        """Cross-entropy against ``batch["labels"]`` (causal LM: position t predicts label t+1, -100 ignored)."""
        labels = batch["labels"]
        if self.task == "causal_lm":
            logits, labels = logits[:, :-1], labels[:, 1:]
            return nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=_IGNORE_INDEX
            )
        return nn.functional.cross_entropy(logits.float(), labels)

    # ------------------------------------------------------------------------------------------------ aux heads
    def make_aux_head(self, kind: str, num_outputs: int | None = None, block_index: int = -1) -> nn.Module:
        """A fresh auxiliary head mapping block ``block_index``'s output to logits (same layout as the final head's).

        Args:
            kind: ``"linear"``, ``"mlp"`` (one hidden layer of the block's width) or ``"lm_head"`` (causal LMs: a
                copy of the final norm + a projection tied to the input embedding).
            num_outputs: Classes / vocabulary (default: the model's).
            block_index: Which block's output it reads (CNN widths differ per block).

        Raises:
            ValueError: unknown kind, ``"lm_head"`` on a classifier, or ``num_outputs`` < 1.
        """
        if kind not in AUX_HEAD_KINDS:
            raise ValueError(f"aux head kind={kind!r} is not one of {list(AUX_HEAD_KINDS)}.")
        outputs = self.num_outputs if num_outputs is None else int(num_outputs)
        if outputs < 1:
            raise ValueError(f"num_outputs={num_outputs!r} must be >= 1.")
        width = self.block_channels[block_index]
        if kind == "lm_head":
            if self.task != "causal_lm":
                raise ValueError(f"aux head kind='lm_head' needs a causal LM; this {self.family} model classifies.")
            if outputs != self.num_outputs:
                raise ValueError(
                    f"an 'lm_head' aux head predicts the {self.num_outputs}-token vocabulary, not {outputs}."
                )
            norm = _copy_module(self.final_head.norm)
            head = NormAndProject(norm, TiedProjection(self._input_embedding()))
        elif self.family == "cnn":
            # Belilovsky et al.: average-pool to 2x2, then a linear map or a one-hidden-layer MLP.
            proj = nn.Linear(4 * width, outputs) if kind == "linear" else _mlp(4 * width, width, outputs)
            head = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), proj)
        else:
            # an LM head has no bias: a bias-free linear aux head can later become the model's head
            linear = nn.Linear(width, outputs, bias=self.task == "classification")
            proj = linear if kind == "linear" else _mlp(width, width, outputs)
            head = NormAndProject(_copy_module(self.final_head.norm), proj, cls_token=self.family == "vit")
        reference = next(self.blocks[block_index].parameters())
        return head.to(device=reference.device, dtype=reference.dtype)

    def _input_embedding(self) -> nn.Embedding:
        return self.stem if isinstance(self.stem, nn.Embedding) else self.stem.wte


def _on_meta(module: nn.Module) -> nn.Module:
    """``module`` if all its tensors are on the meta device, else a copy moved there (for shape inference)."""
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.device.type == "meta" for t in tensors):
        return module
    return copy.deepcopy(module).to("meta")


def _copy_module(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)


def _llama_layer_types(config: Any) -> list[str]:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    sliding = getattr(config, "model_type", "") == "mistral" and getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers
