"""Neuron masks of tiered MatFormer training with ``slice_weights=False`` (a mixin of the runtime).

A tier rank that keeps full weights trains only its neurons: a forward pre-hook on every FFN output projection
multiplies the FFN hidden activations by a 0/1 mask (the rank's prefix, plus this step's helper draw while training).
The product zeroes both the contribution of the other neurons and every gradient through them. Masks are cached per
helper-draw window. :class:`~lightning_hetero.matformer.runtime.MatFormerRuntime` mixes this in; nothing here
imports Lightning or communicates.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hetero.matformer.adapters import FFNBlock
from lightning_hetero.matformer.tiers import HelperConfig, TierLayout, trained_neurons

__all__ = ["NeuronMasks"]


class NeuronMasks:
    """Installs, computes and removes the neuron masks of a masked (``slice_weights=False``) tier rank.

    The host class sets the attributes below (the runtime does in ``__init__`` and ``setup``).
    """

    blocks: list[FFNBlock]
    local_widths: list[int]
    layout: TierLayout | None
    rank: int
    helpers: dict[int, HelperConfig]
    helper_redraw_every: int
    step_fn: Callable[[], int]
    _mask_handles: list[RemovableHandle]
    _masks: dict[tuple[int, bool, int], Tensor]

    def _install_masks(self, module: nn.Module) -> None:
        for block in self.blocks:
            if self.local_widths[block.layer] == block.full_size:
                continue  # a full-width FFN trains every neuron (helpers only exist below full width)
            output = next(p for p in block.projections if p.role == "output")
            hook = partial(self._mask_input, block.layer)
            self._mask_handles.append(module.get_submodule(output.path).register_forward_pre_hook(hook))

    def _mask_input(self, layer: int, projection: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Forward pre-hook of an FFN output projection: zero the hidden units this rank does not train.

        The product zeroes both their contribution and every gradient through them. Training forwards use the
        prefix plus this step's helper draw; evaluation forwards use the prefix only (the tier's own model).
        """
        hidden = args[0]
        training = projection.training
        step = self.step_fn() if training and self.helpers else 0
        key = (layer, training, step // self.helper_redraw_every)
        mask = self._masks.get(key)
        if mask is None:
            assert self.layout is not None
            trained = trained_neurons(
                self.layout, self.rank, layer, helpers=self.helpers if training else None, step=step
            )
            mask = torch.zeros(self.layout.full_size_at(layer), device=hidden.device)
            mask[trained.to(hidden.device)] = 1.0
            self._masks = {k: v for k, v in self._masks.items() if k[1:] == key[1:]}  # keep only this window
            self._masks[key] = mask
        return (hidden * mask.to(hidden.dtype), *args[1:])

    def remove_masks(self) -> None:
        """Remove the neuron-mask hooks (the module then runs at full width)."""
        for handle in self._mask_handles:
            handle.remove()
        self._mask_handles, self._masks = [], {}
