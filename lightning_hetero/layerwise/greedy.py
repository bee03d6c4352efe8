"""Greedy layerwise training (Belilovsky et al., 2018), framework-free: :class:`GreedyStages`.

Stage ``j`` trains block ``j`` (and the stem when ``j == 0``) through its own head, an auxiliary head from
:meth:`~lightning_hetero.layerwise.stack.BlockStack.make_aux_head`, or, on the last stage, the model's own final
head (unless ``keep_last_aux`` trains an auxiliary head there and :meth:`GreedyStages.export_` copies it into the
model's head). Everything before block ``j`` is frozen: ``requires_grad=False``, run in eval mode without a graph, or
read from an :class:`~lightning_hetero.layerwise.cache.ActivationCache`.

Use it from any loop::

    stages = GreedyStages(split_into_blocks(model, num_blocks=4), aux_head="linear")
    for stage in range(stages.num_stages):
        stages.enter_stage(stage)
        optimizer = torch.optim.AdamW(stages.active_parameters(), lr=1e-3)
        for batch in loader:  # batch dicts, e.g. {"pixel_values", "labels"} (+ "index" for an index-keyed cache)
            optimizer.zero_grad()
            stages.stage_loss(batch).backward()
            optimizer.step()
    stages.export_()  # the model is an ordinary model again (aux heads are not part of it)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hetero.layerwise.cache import ActivationCache, content_keys
from lightning_hetero.layerwise.stack import BlockStack

__all__ = ["GreedyStages", "SplitMismatchError"]


class SplitMismatchError(ValueError):
    """A checkpoint was written under another block split than the one now configured."""


@contextmanager
def _eval_mode(modules: list[nn.Module]) -> Iterator[None]:
    """Eval mode (no dropout) for the frozen prefix, restoring each module's mode afterwards."""
    saved = [(m, m.training) for module in modules for m in module.modules()]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module, training in saved:
            module.training = training


def _unique(parameters: Any) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for parameter in parameters:
        seen.setdefault(id(parameter), parameter)
    return list(seen.values())


class GreedyStages:
    """Which block trains now, through which head, and on what input (see the module docstring).

    Args:
        stack: The block split (:func:`~lightning_hetero.layerwise.blocks.split_into_blocks`).
        aux_head: Kind of the auxiliary heads (``"linear"``, ``"mlp"``, ``"lm_head"``).
        aux_outputs: Outputs of the auxiliary heads (default: the model's classes / vocabulary).
        keep_last_aux: Train the last block with an auxiliary head too and copy it into the model's head on
            :meth:`export_` (its layout must match the model's head; checked here). Default: the last block trains
            with the model's own head and every auxiliary head is dropped.
        cache: Activation cache for the frozen prefix (None: recompute it every step).
        index_key: Batch entry with each sample's dataset index, used as the cache key when present (otherwise the
            key is a hash of the sample's model inputs, :func:`~lightning_hetero.layerwise.cache.content_keys`).
    """

    def __init__(
        self,
        stack: BlockStack,
        aux_head: str = "linear",
        aux_outputs: int | None = None,
        keep_last_aux: bool = False,
        cache: ActivationCache | None = None,
        index_key: str = "index",
    ) -> None:
        self.stack = stack
        self.aux_kind = aux_head
        self.keep_last_aux = keep_last_aux
        self.cache = cache
        self.index_key = index_key
        count = stack.num_blocks if keep_last_aux else stack.num_blocks - 1
        self.aux_heads = nn.ModuleList(
            [stack.make_aux_head(aux_head, aux_outputs, block_index=j) for j in range(count)]
        )
        if keep_last_aux:
            self._check_exportable()
        self.stage = 0
        self.enter_stage(0)

    # ------------------------------------------------------------------------------------------------ stages
    @property
    def num_stages(self) -> int:
        return self.stack.num_blocks

    def head(self, stage: int) -> nn.Module:
        """The head block ``stage`` trains through."""
        return self.aux_heads[stage] if stage < len(self.aux_heads) else self.stack.final_head

    def frozen_modules(self, stage: int) -> list[nn.Module]:
        """The prefix in front of block ``stage``: the stem (for ``stage > 0``) and blocks ``0 .. stage - 1``."""
        return [] if stage == 0 else [self.stack.stem, *self.stack.blocks[:stage]]

    def active_parameters(self, stage: int | None = None) -> list[nn.Parameter]:
        """Parameters stage ``stage`` (default: the current one) trains: its block, its head, the stem on stage 0,
        without any parameter shared with the frozen prefix (GPT-2's tied LM head stays frozen after stage 0)."""
        stage = self.stage if stage is None else stage
        modules = [self.stack.blocks[stage], self.head(stage)] + ([self.stack.stem] if stage == 0 else [])
        frozen = {id(p) for module in self.frozen_modules(stage) for p in module.parameters()}
        return [p for p in _unique(p for m in modules for p in m.parameters()) if id(p) not in frozen]

    def all_parameters(self) -> list[nn.Parameter]:
        """Every parameter of the model parts and the auxiliary heads."""
        stack = self.stack
        modules = [stack.stem, *stack.blocks, stack.final_head, *self.aux_heads]
        return _unique(p for m in modules for p in m.parameters())

    def enter_stage(self, stage: int) -> None:
        """Make ``stage`` current: only its :meth:`active_parameters` require grad; the cache forgets levels it no
        longer needs."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage={stage} is outside 0..{self.num_stages - 1}.")
        self.stage = stage
        active = {id(p) for p in self.active_parameters(stage)}
        for parameter in self.all_parameters():
            parameter.requires_grad_(id(parameter) in active)
        if self.cache is not None:
            self.cache.drop_levels_below(stage - 1)

    # ------------------------------------------------------------------------------------------------ forward
    def sample_keys(self, batch: Mapping[str, Any]) -> list[str]:
        """Cache keys of the batch's samples: ``batch[index_key]`` when present, else content hashes."""
        batch = self.stack.as_batch(batch)
        if self.index_key in batch:
            return [f"i{int(index)}" for index in torch.as_tensor(batch[self.index_key]).reshape(-1).tolist()]
        return content_keys(self.stack.model_inputs(batch))

    def stage_input(self, batch: Mapping[str, Any], context: Mapping[str, Any] | None = None) -> Tensor:
        """Block ``stage``'s input for the batch: the stem's output (with grad) on stage 0, else the frozen prefix's
        output (no grad), from the cache where it holds the whole batch."""
        stack, stage = self.stack, self.stage
        batch = stack.as_batch(batch)
        if stage == 0:
            return stack.embed(batch)
        context = stack.context_of(batch) if context is None else context
        cache = self.cache
        keys = self.sample_keys(batch) if cache is not None else None
        device = stack.device
        if cache is not None and cache.has_all(stage, keys):
            cache.hits += 1
            return cache.get_many(stage, keys).to(device)
        with torch.no_grad(), _eval_mode(self.frozen_modules(stage)):
            if cache is not None and stage >= 2 and cache.has_all(stage - 1, keys):
                # one block on top of the previous stage's cached input: later stages pay only for their own block
                hidden = stack.blocks[stage - 1](cache.get_many(stage - 1, keys).to(device), context)
            else:
                hidden = stack.embed(batch)
                for block in stack.blocks[:stage]:
                    hidden = block(hidden, context)
        if cache is not None:
            cache.misses += 1
            cache.put_many(stage, keys, hidden)
        return hidden

    def stage_logits(self, batch: Mapping[str, Any]) -> Tensor:
        """Logits of the current stage's head on the current block's output."""
        batch = self.stack.as_batch(batch)
        context = self.stack.context_of(batch)
        hidden = self.stack.blocks[self.stage](self.stage_input(batch, context), context)
        return self.head(self.stage)(hidden)

    def stage_loss(self, batch: Mapping[str, Any]) -> Tensor:
        """The current stage's training loss (cross-entropy of its head against ``batch["labels"]``; an
        ``(inputs, labels)`` pair works too)."""
        batch = self.stack.as_batch(batch)
        return self.stack.loss(self.stage_logits(batch), batch)

    # ------------------------------------------------------------------------------------------------ export
    def _check_exportable(self) -> None:
        final, aux = self.stack.final_head.state_dict(), self.aux_heads[-1].state_dict()
        if self.aux_kind == "lm_head":
            return
        mismatch = {k: tuple(v.shape) for k, v in aux.items() if k not in final or final[k].shape != v.shape}
        missing = [k for k in final if k not in aux]
        if mismatch or missing:
            raise ValueError(
                f"keep_last_aux_head=True needs the last auxiliary head to have the layout of the model's own head, "
                f"but the {self.aux_kind!r} head of this {self.stack.family} model differs (its entries "
                f"{sorted(mismatch) or 'none'} do not fit, the model head's {missing or 'none'} are missing). Use "
                f"aux_head='linear' (ViT, LM) or keep_last_aux_head=False (the last block then trains with the "
                f"model's own head)."
            )

    @torch.no_grad()
    def export_(self) -> nn.Module:
        """Leave the model as an ordinary model: with ``keep_last_aux`` copy the last auxiliary head into the model's
        head; all parameters require grad again. Returns the split's root module (e.g. the HF model)."""
        if self.keep_last_aux:
            aux, final = self.aux_heads[-1], self.stack.final_head
            if self.aux_kind == "lm_head":
                final.norm.load_state_dict(aux.norm.state_dict())
                embedding = self.stack._input_embedding()
                if final.proj.weight is not embedding.weight:
                    final.proj.weight.copy_(embedding.weight)
            else:
                final.load_state_dict(aux.state_dict())
        for parameter in self.all_parameters():
            parameter.requires_grad_(True)
        return self.stack.root

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``stage``, ``signature`` (of the split, checked on load), ``aux_kind`` and the auxiliary heads' tensors."""
        return {
            "stage": self.stage,
            "signature": self.stack.signature,
            "aux_kind": self.aux_kind,
            "keep_last_aux": self.keep_last_aux,
            "aux_heads": {k: v.detach().clone() for k, v in self.aux_heads.state_dict().items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            SplitMismatchError: the state was saved under another split, head kind or ``keep_last_aux``.
        """
        saved = (state["signature"], state["aux_kind"], bool(state["keep_last_aux"]))
        now = (self.stack.signature, self.aux_kind, self.keep_last_aux)
        if saved != now:
            raise SplitMismatchError(
                f"the checkpoint was trained greedily with split {saved[0]!r}, aux_head={saved[1]!r}, "
                f"keep_last_aux_head={saved[2]} but the run is configured with split {now[0]!r}, aux_head={now[1]!r}, "
                f"keep_last_aux_head={now[2]}. Resume with the checkpoint's num_blocks/boundaries and head settings "
                f"(or start a new run)."
            )
        self.aux_heads.load_state_dict(state["aux_heads"])
        self.enter_stage(int(state["stage"]))
