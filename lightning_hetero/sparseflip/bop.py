"""Bop-style flip optimizer: an exponential moving average of the code gradient per code, flip past a threshold.

After Helwegen et al. 2019, "Latent weights do not exist: rethinking binarized neural network optimization", written
from the paper's update rule. Per code with gradient ``g = dL/dcode`` (the layer's ``code_grad``)::

    g' = g / rms(g over the layer)       (only with normalize=True; one scalar per layer and step)
    m  = (1 - gamma) * m + gamma * g'
    d  = -sign(m)  where |m| > threshold, else 0
    move the code one step in d where allowed (binary: flip the sign; ternary: -1 -> 0 -> +1)

For a binary code the move is allowed when ``sign(m) == code`` (Bop's "flip when the momentum agrees with the
weight"), i.e. the code is not already ``d``. Bop needs no reset (``reset=1.0``): after a flip the momentum pushes
the other way only once the gradients turn. A ternary code could take a second step in the same direction on the
next step, so a move multiplies that code's ``m`` by ``reset``; the default 0 (start over: one step per threshold
crossing) measured better for ternary *and* binary codes on digits / MNIST (binary MLP on digits: 0.977 vs 0.891
test accuracy), presumably because it stops codes near the threshold from flipping back and forth on noise.

``normalize=True`` makes ``threshold`` unitless (a fraction of the layer's gradient rms), so one setting serves
layers whose gradients differ by orders of magnitude, and a trainable scale does not shift it. The state is one fp16
number per code (2 bytes) or one int8 (1 byte: ``m`` in units of ``range / 127`` with stochastic rounding from the
seeded generator, ``range = 2 * threshold`` fixed at construction). Deterministic given the seed: replicas that see the
same gradients make the same moves, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_hetero.sparseflip.flip import FlipOptimizer, apply_moves, check_bop_parameters
from lightning_hetero.sparseflip.layers import _LowBitWeight

__all__ = ["BopFlip"]

_LEVELS = 127


class BopFlip(FlipOptimizer):
    """Move a code one step in ``-sign(m)`` when ``|m| > threshold``, ``m`` an EMA of its (normalized) gradient.

    Args:
        layers: A module or a sequence of flip-mode layers.
        gamma: EMA rate (``m = (1 - gamma) m + gamma g``), in (0, 1].
        threshold: ``|m|`` above which a code moves (a fraction of the layer's gradient rms with ``normalize``).
        normalize: Divide each layer's gradient by its rms before the EMA.
        reset: Factor applied to ``m`` of a code that moved, in [0, 1] (1.0 is Bop's "no reset").
        dtype: ``torch.float16`` (2 bytes per code) or ``torch.int8`` (1 byte per code, stochastic rounding).
        seed: Generator seed (used by the int8 state only, but every replica must pass the same one).
    """

    def __init__(
        self,
        layers: nn.Module | Sequence[_LowBitWeight],
        gamma: float = 1e-2,
        threshold: float = 0.5,
        normalize: bool = True,
        reset: float = 0.0,
        dtype: torch.dtype = torch.float16,
        seed: int = 0,
    ) -> None:
        super().__init__(layers, seed)
        check_bop_parameters(gamma, threshold, reset)
        if dtype not in (torch.float16, torch.int8):
            raise ValueError(f"dtype must be torch.float16 or torch.int8, got {dtype}.")
        self.gamma, self.threshold, self.normalize, self.reset, self.dtype = gamma, threshold, normalize, reset, dtype
        self.unit = 2.0 * threshold / _LEVELS  # int8 state: value of one level
        self.momenta = [torch.zeros_like(layer.codes, dtype=dtype) for layer in self.layout.layers]

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"m.{i}": m for i, m in enumerate(self.momenta)}

    def step(self) -> int:
        """Update the momenta from the layers' ``code_grad`` and move; returns the number of codes that moved.

        A layer without a gradient keeps its momentum (no decay) and draws nothing from the generator.
        """
        moved = 0
        for layer, grad, state in zip(self.layout.layers, self._grads(), self.momenta, strict=True):
            if grad is None:
                continue
            g = grad.float()
            if self.normalize:
                g = g / g.pow(2).mean().sqrt().clamp(min=1e-30)
            if self.dtype == torch.int8:
                m = state.float() * self.unit
                draw = torch.rand(layer.codes.shape, generator=self.generator, device=layer.codes.device)
            else:
                m = state.float()
            m = (1.0 - self.gamma) * m + self.gamma * g
            if self.dtype == torch.float16:
                m = m.to(torch.float16).float()  # decide on the value that is stored
            else:
                m = torch.floor(m / self.unit + draw).clamp_(-_LEVELS, _LEVELS) * self.unit
            fire = m.abs() > self.threshold
            direction = torch.where(fire, -torch.sign(m), torch.zeros_like(m)).to(torch.int8)
            moves = apply_moves(layer.codes, direction, layer.kind)
            moved += int(moves.sum())
            if self.reset != 1.0:
                m = torch.where(moves, m * self.reset, m)
            state.copy_(
                m.to(torch.float16) if self.dtype == torch.float16 else torch.round(m / self.unit).to(torch.int8)
            )
        self.flips_last_step = moved
        return moved
