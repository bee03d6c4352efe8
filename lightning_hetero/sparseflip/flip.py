"""Flip optimizers for weights held only as int8 codes (``mode="flip"`` layers).

A *move* of a code is one step in direction ``d = -sign(g)``, ``g = dL/dcodes`` (the layer's ``code_grad``): a ternary
code goes ``-1 -> 0 -> +1`` (or back), a binary code changes sign. A move is *allowed* when ``d != 0`` and the code is
not already saturated in that direction (``code != d``; for binary codes this means "not already equal to ``d``"), so
a ternary +1 never receives a further +1 and a disallowed move is simply not made.

Rules (all deterministic given the seed; replicas that see the same gradients stay bit-identical):

- :class:`StochasticFlip`: move with probability ``clamp(lr * |g|, 0, 1)`` (the seed essay's "if we can't flip a bit
  by 0.01, flip it 1% of the time"), one uniform draw per code per step from a seeded ``torch.Generator``.
- :class:`TopKFlip`: move the ``k`` allowed codes with the largest ``|g|`` per step, per layer or globally (ties go
  to the lower flat index).
- :class:`AccumulatedFlip`: a small per-code accumulator (fp16, or int8 with stochastic rounding) sums ``lr * g``;
  a code moves when ``|acc|`` reaches ``threshold`` and its accumulator is reset to zero.

:class:`CodeLayout` concatenates the codes of several layers into one flat index space (layer order), which is also
the index space of the sparse exchange in :mod:`lightning_hetero.sparseflip.sparse`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_hetero.sparseflip.layers import _LowBitWeight, lowbit_layers

__all__ = [
    "AccumulatedFlip",
    "CodeLayout",
    "FlipOptimizer",
    "StochasticFlip",
    "TopKFlip",
    "apply_moves",
    "check_bop_parameters",
    "move_allowed",
    "topk_moves",
]


def check_bop_parameters(gamma: float, threshold: float, reset: float) -> None:
    """Raise ``ValueError`` unless Bop's ``gamma`` is in (0, 1], ``threshold`` > 0 and ``reset`` in [0, 1].

    One check for both Bop flavours: the local optimizer (:class:`~lightning_hetero.sparseflip.bop.BopFlip`) and the
    rule on the aggregated gradient (:class:`~lightning_hetero.sparseflip.rules.BopRule`).
    """
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}.")
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}.")
    if not 0 <= reset <= 1:
        raise ValueError(f"reset must be in [0, 1], got {reset}.")


def move_allowed(codes: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """Bool mask of codes that may move one step in ``direction`` (``d != 0`` and not saturated: ``code != d``)."""
    return (direction != 0) & (codes != direction)


def apply_moves(codes: torch.Tensor, direction: torch.Tensor, kind: str) -> torch.Tensor:
    """Move ``codes`` (int8, in place) one step in ``direction`` (int8, 0 = stay) where allowed; returns the mask moved.

    Args:
        codes: int8 codes, modified in place.
        direction: Same shape, values in ``{-1, 0, 1}``.
        kind: ``"ternary"`` (``code += d``) or ``"binary"`` (``code = d``).
    """
    moved = move_allowed(codes, direction)
    new = codes + direction if kind == "ternary" else direction
    codes.copy_(torch.where(moved, new.to(torch.int8), codes))
    return moved


def topk_moves(grad: torch.Tensor, codes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` allowed moves of largest ``|grad|`` over flat tensors, ties to the lower index.

    Args:
        grad: Flat float gradient ``dL/dcodes``.
        codes: Flat int8 codes (same length).
        k: Maximum number of moves (fewer when fewer are allowed with a non-zero gradient).

    Returns:
        ``(indices int64 ascending, directions int8 in {-1, +1})``.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}.")
    direction = -torch.sign(grad).to(torch.int8)
    score = torch.where(move_allowed(codes, direction), grad.abs().float(), torch.zeros((), device=grad.device))
    order = torch.argsort(score, descending=True, stable=True)[: min(k, score.numel())]
    chosen = order[score[order] > 0].sort().values
    return chosen, direction[chosen]


class CodeLayout:
    """The flip-mode layers of a model as one flat index space (concatenated in the given order).

    Args:
        layers: A module (its flip-mode low-bit layers are used, in module order) or a sequence of layers.
    """

    def __init__(self, layers: nn.Module | Sequence[_LowBitWeight]) -> None:
        if isinstance(layers, nn.Module):
            layers = [layer for _, layer in lowbit_layers(layers, mode="flip")]
        self.layers: list[_LowBitWeight] = list(layers)
        for layer in self.layers:
            if not isinstance(layer, _LowBitWeight) or layer.mode != "flip":
                raise ValueError(f"CodeLayout needs flip-mode low-bit layers, got {type(layer).__name__}.")
        sizes = [layer.codes.numel() for layer in self.layers]
        self.offsets: list[int] = [0]
        for size in sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.kinds: list[str] = [layer.kind for layer in self.layers]

    @property
    def numel(self) -> int:
        """Total number of codes."""
        return self.offsets[-1]

    @property
    def kind(self) -> str:
        """The common kind of all layers (ValueError when they are mixed)."""
        kinds = set(self.kinds)
        if len(kinds) != 1:
            raise ValueError(f"layers mix kinds {sorted(kinds)}; use one kind per layout.")
        return self.kinds[0]

    def flat_codes(self) -> torch.Tensor:
        """All codes as one flat int8 tensor (a copy)."""
        return torch.cat([layer.codes.reshape(-1) for layer in self.layers]) if self.layers else torch.zeros(0)

    def flat_grad(self) -> torch.Tensor:
        """All ``code_grad`` as one flat float32 tensor (zeros for layers without a gradient)."""
        parts = [
            layer.code_grad.reshape(-1).float()
            if layer.code_grad is not None
            else torch.zeros(layer.codes.numel(), device=layer.codes.device)
            for layer in self.layers
        ]
        return torch.cat(parts) if parts else torch.zeros(0)

    def apply(self, indices: torch.Tensor, directions: torch.Tensor) -> int:
        """Move the codes at flat ``indices`` one step in ``directions`` (disallowed moves are skipped).

        Returns:
            The number of codes that moved.
        """
        indices = indices.reshape(-1).long()
        directions = directions.reshape(-1).to(torch.int8)
        moved = 0
        for i, layer in enumerate(self.layers):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            inside = (indices >= lo) & (indices < hi)
            if not bool(inside.any()):
                continue
            flat = layer.codes.view(-1)
            local = indices[inside] - lo
            step = torch.zeros_like(flat)
            step[local.to(flat.device)] = directions[inside].to(flat.device)
            moved += int(apply_moves(flat, step, layer.kind).sum())
        return moved

    def zero_grad(self) -> None:
        """Clear every layer's ``code_grad``."""
        for layer in self.layers:
            layer.zero_code_grad()


class FlipOptimizer:
    """Base class: holds the :class:`CodeLayout` and a seeded generator; subclasses implement :meth:`step`.

    Args:
        layers: A module or a sequence of flip-mode layers.
        seed: Seed of the generator (every replica must use the same one).
    """

    def __init__(self, layers: nn.Module | Sequence[_LowBitWeight], seed: int = 0) -> None:
        self.layout = CodeLayout(layers)
        device = self.layout.layers[0].codes.device if self.layout.layers else torch.device("cpu")
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.flips_last_step = 0

    def step(self) -> int:
        """Apply one update from the layers' ``code_grad``; returns the number of codes that moved."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Clear every layer's ``code_grad``."""
        self.layout.zero_grad()

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Generator state and per-code state (enough to resume bit-identically)."""
        return {"generator": self.generator.get_state(), **{k: v.clone() for k, v in self._state_tensors().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.generator.set_state(state["generator"])
        for key, tensor in self._state_tensors().items():
            tensor.copy_(state[key])

    def state_bytes(self) -> dict[str, float]:
        """Bytes of weights + optimizer state, against fp32 AdamW (4 bytes weight + 8 bytes moments per parameter).

        Counted per parameter: int8 codes (1 byte each; ``*_packed`` counts 2 bits per trit / 1 bit per binary code
        instead), fp32 scales and the optimizer's per-code state. The generator state is a constant independent of
        the model (``rng_bytes``, not in the totals). Gradients are transient (like ``.grad`` for AdamW) and not
        counted; biases and other fp parameters are outside the layout and not counted either.
        """
        params = self.layout.numel
        scales = sum(4 * layer.scale.numel() for layer in self.layout.layers)
        packed = sum(
            (layer.codes.numel() * (2 if layer.kind == "ternary" else 1) + 7) // 8 for layer in self.layout.layers
        )
        optimizer = sum(t.numel() * t.element_size() for t in self._state_tensors().values())
        adamw = 12 * params
        total = params + scales + optimizer
        return {
            "params": params,
            "weight_bytes": params + scales,
            "weight_bytes_packed": packed + scales,
            "optimizer_bytes": optimizer,
            "rng_bytes": self.generator.get_state().numel(),
            "total_bytes": total,
            "total_bytes_packed": packed + scales + optimizer,
            "adamw_fp32_bytes": adamw,
            "ratio_vs_adamw": total / adamw if adamw else 0.0,
        }

    def _grads(self) -> list[torch.Tensor | None]:
        return [layer.code_grad for layer in self.layout.layers]


class StochasticFlip(FlipOptimizer):
    """Move each code with probability ``clamp(lr * |g|, 0, 1)`` in direction ``-sign(g)``.

    Args:
        layers: A module or a sequence of flip-mode layers.
        lr: Probability per unit of ``|dL/dcode|``.
        seed: Generator seed.
    """

    def __init__(self, layers: nn.Module | Sequence[_LowBitWeight], lr: float, seed: int = 0) -> None:
        super().__init__(layers, seed)
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}.")
        self.lr = lr

    def step(self) -> int:
        """One stochastic update; draws one uniform per code (also for layers without a gradient)."""
        moved = 0
        for layer, grad in zip(self.layout.layers, self._grads(), strict=True):
            draw = torch.rand(layer.codes.shape, generator=self.generator, device=layer.codes.device)
            if grad is None:
                continue
            probability = (self.lr * grad.abs()).clamp_(0.0, 1.0)
            direction = torch.where(draw < probability, -torch.sign(grad), torch.zeros_like(grad)).to(torch.int8)
            moved += int(apply_moves(layer.codes, direction, layer.kind).sum())
        self.flips_last_step = moved
        return moved


class TopKFlip(FlipOptimizer):
    """Move the ``k`` allowed codes with the largest ``|g|`` per step.

    Args:
        layers: A module or a sequence of flip-mode layers.
        k: Moves per step (per layer with ``scope="layer"``, in total with ``"global"``).
        scope: ``"layer"`` or ``"global"``.
        seed: Generator seed (unused by the rule; kept for a uniform interface).
    """

    def __init__(
        self, layers: nn.Module | Sequence[_LowBitWeight], k: int, scope: str = "layer", seed: int = 0
    ) -> None:
        super().__init__(layers, seed)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}.")
        if scope not in ("layer", "global"):
            raise ValueError(f"scope must be 'layer' or 'global', got {scope!r}.")
        self.k, self.scope = k, scope

    def step(self) -> int:
        """One deterministic top-k update."""
        if self.scope == "global":
            indices, directions = topk_moves(self.layout.flat_grad(), self.layout.flat_codes(), self.k)
            moved = self.layout.apply(indices, directions)
        else:
            moved = 0
            for layer, grad in zip(self.layout.layers, self._grads(), strict=True):
                if grad is None:
                    continue
                flat = layer.codes.view(-1)
                indices, directions = topk_moves(grad.reshape(-1), flat, self.k)
                step = torch.zeros_like(flat)
                step[indices] = directions
                moved += int(apply_moves(flat, step, layer.kind).sum())
        self.flips_last_step = moved
        return moved


class AccumulatedFlip(FlipOptimizer):
    """Accumulate ``lr * g`` per code; move where ``|acc| >= threshold`` and reset that accumulator to zero.

    Args:
        layers: A module or a sequence of flip-mode layers.
        lr: Scale of the gradient added to the accumulator.
        threshold: Accumulated magnitude that triggers a move.
        dtype: ``torch.float16`` (2 bytes per code) or ``torch.int8`` (1 byte per code: ``acc`` in units of
            ``threshold / 127``, increments stochastically rounded with the seeded generator).
        seed: Generator seed.
    """

    _LEVELS = 127

    def __init__(
        self,
        layers: nn.Module | Sequence[_LowBitWeight],
        lr: float,
        threshold: float = 1.0,
        dtype: torch.dtype = torch.float16,
        seed: int = 0,
    ) -> None:
        super().__init__(layers, seed)
        if dtype not in (torch.float16, torch.int8):
            raise ValueError(f"dtype must be torch.float16 or torch.int8, got {dtype}.")
        if lr < 0 or threshold <= 0:
            raise ValueError(f"need lr >= 0 and threshold > 0, got {lr} and {threshold}.")
        self.lr, self.threshold, self.dtype = lr, threshold, dtype
        self.accumulators = [torch.zeros_like(layer.codes, dtype=dtype) for layer in self.layout.layers]

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"acc.{i}": acc for i, acc in enumerate(self.accumulators)}

    def step(self) -> int:
        """Accumulate and move."""
        moved = 0
        for layer, grad, acc in zip(self.layout.layers, self._grads(), self.accumulators, strict=True):
            if self.dtype == torch.int8:
                draw = torch.rand(layer.codes.shape, generator=self.generator, device=layer.codes.device)
                if grad is None:
                    continue
                increment = torch.floor(self.lr * grad.float() * (self._LEVELS / self.threshold) + draw)
                total = (acc.float() + increment).clamp_(-self._LEVELS, self._LEVELS)
                fire = total.abs() >= self._LEVELS
            else:
                if grad is None:
                    continue
                total = (acc.float() + self.lr * grad.float()).to(torch.float16).float()
                fire = total.abs() >= self.threshold
            direction = torch.where(fire, -torch.sign(total), torch.zeros_like(total)).to(torch.int8)
            moved += int(apply_moves(layer.codes, direction, layer.kind).sum())
            acc.copy_(torch.where(fire, torch.zeros_like(total), total).to(self.dtype))
        self.flips_last_step = moved
        return moved
