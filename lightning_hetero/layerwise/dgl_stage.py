"""This rank's share of a decoupled greedy (DGL) pipeline: its block, its local head, and where it lives.

:func:`build_dgl_stage` cuts the user's model with :func:`lightning_hetero.layerwise.blocks.split_into_blocks` (one
block per stage) and keeps what stage ``s`` trains in a :class:`DGLStageModel`:

- ``stem`` (stage 0 only): the embedding / patch embedding;
- ``block``: block ``s``;
- ``head``: on the last stage the model's own final head (final norm + LM head / classifier), elsewhere a fresh
  auxiliary head of ``aux_head`` kind (``"linear"``, ``"mlp"``, or ``"lm_head"``: the final norm and a projection
  initialised from the LM head's weight; never tied to another stage's parameters).

The container takes the place of the HF model inside the user's module, so ``configure_optimizers``
(``self.parameters()``) sees only this stage's parameters. Weights shared between this stage and another (a tied LM
head) are untied by a copy, and the other stages' blocks are released to the meta device. Nothing here imports
Lightning.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hetero.layerwise.blocks import split_into_blocks
from lightning_hetero.layerwise.stack import AUX_HEAD_KINDS, BlockStack
from lightning_hetero.pipeline.stage_holder import StageHolder

__all__ = ["DGLStageModel", "build_dgl_stage", "check_head_output"]


class DGLStageModel(StageHolder):
    """Holds one stage of a DGL pipeline in place of the user's model (see the module docstring).

    Calling it is an error: the strategy runs the stage (``strategy.train_step`` / ``eval_step``).
    """

    pipeline_name = "LayerwiseStrategy (DGL)"
    how_to_run = (
        "The strategy runs it (Trainer), or call strategy.train_step(batch) / strategy.eval_step(batch) (Fabric)."
    )

    def __init__(
        self, stem: nn.Module | None, block: nn.Module, head: nn.Module, stage_index: int, num_stages: int, config: Any
    ) -> None:
        super().__init__(config, stage_index, num_stages)
        self.stem = stem
        self.block = block
        self.head = head


def check_head_output(head_output: Tensor, num_outputs: int, stage: int, kind: str) -> None:
    """Raise a clear error when a head's logits do not end in ``num_outputs`` (classes / vocabulary)."""
    if head_output.shape[-1] != num_outputs:
        raise ValueError(
            f"LayerwiseStrategy: the auxiliary head of stage {stage} (aux_head={kind!r}) gives logits with "
            f"{head_output.shape[-1]} outputs, but the model predicts {num_outputs} classes/tokens. Use an aux head "
            f"whose last layer has {num_outputs} outputs (or aux_outputs=None for the model's own)."
        )


def _aux_head(stack: BlockStack, kind: str, stage: int, num_outputs: int | None) -> nn.Module:
    if kind == "lm_head":
        head = stack.make_aux_head("linear", num_outputs, block_index=stage)  # norm copy + a fresh projection
        head.proj.weight.data.copy_(stack.final_head.proj.weight.detach())  # ... initialised like the LM head
        return head
    return stack.make_aux_head(kind, num_outputs, block_index=stage)


def _untie(module: nn.Module, foreign: set[int]) -> None:
    """Give ``module`` its own copy of every parameter whose id is in ``foreign`` (owned by another stage)."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) in foreign:
                sub._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)


def _detach_root(stack: BlockStack) -> None:
    """Point ``stack.root`` at a shallow copy of the HF model, so hollowing the original keeps ``context_of`` alive."""
    ghost = copy.copy(stack.root)
    for registry in ("_modules", "_parameters", "_buffers"):
        ghost.__dict__[registry] = dict(stack.root.__dict__[registry])
    stack.root = ghost


def _place(module: nn.Module, root: nn.Module, container: DGLStageModel) -> None:
    """Put ``container`` where ``root`` (the HF model) sits inside ``module``; hollow ``root`` if it is ``module``."""
    if module is root:
        for registry in (module._modules, module._parameters, module._buffers):
            registry.clear()
        module.dgl_stage = container
        module.forward = container.forward  # type: ignore[method-assign]
        return
    for parent in module.modules():
        for name, child in parent.named_children():
            if child is root:
                setattr(parent, name, container)
                return
    raise RuntimeError("LayerwiseStrategy: could not find the model inside the module to replace it by the stage.")


def build_dgl_stage(
    module: nn.Module,
    num_stages: int,
    stage: int,
    boundaries: Sequence[int] | None,
    aux_head: str,
    aux_outputs: int | None,
    device: torch.device,
) -> tuple[BlockStack, DGLStageModel]:
    """Split the model inside ``module`` into ``num_stages`` blocks and put stage ``stage`` in its place.

    Returns the :class:`BlockStack` (for ``embed``/``context_of``/``loss``; its ``root`` is kept alive for the
    context) and the stage container.

    Raises:
        ValueError: a split that does not fit the model (from ``split_into_blocks``, naming the arguments), or an
            auxiliary head whose outputs do not match the model's classes / vocabulary.
    """
    try:
        if boundaries is None:
            stack = split_into_blocks(module, num_blocks=num_stages)
        else:
            stack = split_into_blocks(module, boundaries=list(boundaries))
    except ValueError as error:
        raise ValueError(
            f"LayerwiseStrategy: settings.pipeline.num_stages={num_stages}, settings.boundaries={boundaries}: {error}"
        ) from None
    if stack.num_blocks != num_stages:
        raise ValueError(
            f"LayerwiseStrategy: settings.pipeline.num_stages={num_stages}, settings.boundaries="
            f"{list(boundaries or [])}: the boundaries make {stack.num_blocks} blocks; give num_stages - 1 = "
            f"{num_stages - 1} boundaries (one block per stage)."
        )
    last = stage == num_stages - 1
    if aux_head not in AUX_HEAD_KINDS:
        raise ValueError(f"LayerwiseSettings.aux_head={aux_head!r}: use one of {list(AUX_HEAD_KINDS)}.")
    if aux_head == "lm_head" and stack.task != "causal_lm":
        raise ValueError(f"LayerwiseSettings.aux_head='lm_head': needs a causal LM; this {stack.family} classifies.")
    if aux_outputs is not None and aux_outputs != stack.num_outputs:
        raise ValueError(
            f"LayerwiseSettings.aux_outputs={aux_outputs}: the model predicts {stack.num_outputs} classes/tokens and "
            f"every stage's loss uses its labels; use aux_outputs=None (or {stack.num_outputs})."
        )
    head = stack.final_head if last else _aux_head(stack, aux_head, stage, aux_outputs)
    stem = stack.stem if stage == 0 else None
    kept = nn.ModuleList([m for m in (stem, stack.blocks[stage], head) if m is not None])
    others = [stack.blocks[j] for j in range(num_stages) if j != stage]
    if stage != 0:
        others.append(stack.stem)
    if not last:
        others.append(stack.final_head)
    _untie(kept, {id(p) for other in others for p in other.parameters()})
    root = stack.root
    _detach_root(stack)
    with torch.no_grad():
        for other in others:
            other.to("meta")  # release what other stages train (the rotary tables and config stay)
    container = DGLStageModel(stem, stack.blocks[stage], head, stage, num_stages, getattr(root, "config", None))
    container.to(device)
    _place(module, root, container)
    return stack, container
