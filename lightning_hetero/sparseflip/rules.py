"""How the aggregated code gradient becomes the common flip set of the ``sparseflip`` exchange.

Both rules see the same input on whichever rank decides (the parameter server, or every rank in all-gather mode):
``mean`` = the rank-order sum of the decoded sparse lists divided by the number of ranks (zero where nobody sent),
and the current flat codes. They return ``(indices ascending, directions in {-1, +1})`` of allowed moves only.

- :class:`TopKRule` (the seed's rule): the ``k`` allowed moves of largest ``|mean|``.
- :class:`ThresholdRule` with :class:`LocalBop` (settings ``flip.rule="local_bop"``, the default): every rank keeps
  Bop's momentum of its own dense, rms-normalized code gradient and sends only the momenta past
  ``exchange.send_threshold_ratio * threshold``; the decider moves the codes whose mean momentum over the ranks passes
  ``threshold``, and every rank resets the momentum of the codes that moved. The momentum is the memory, so nothing a
  rank does not send is lost, and with one rank it is exactly :class:`~lightning_hetero.sparseflip.bop.BopFlip`.
- :class:`BopRule`: Bop (Helwegen et al. 2019) on the aggregate, as :class:`~lightning_hetero.sparseflip.bop.BopFlip`
  does on a dense gradient: per layer, the sent entries are divided by their rms, an fp16 moving average
  ``m = (1 - gamma) m + gamma g'`` is kept per code, a code moves one step against ``m`` when ``|m| > threshold``
  (at most ``cap`` moves, the largest ``|m|`` first), and the momentum of a code that moves is multiplied by
  ``reset``. Entries nobody sent count as zero gradient (their momentum decays). The normalization uses only the sent
  entries, so a sparse step has the same scale as a dense one; with every entry sent it equals ``BopFlip``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_hetero.sparseflip.flip import check_bop_parameters, move_allowed, topk_moves

__all__ = ["BopRule", "LocalBop", "ThresholdRule", "TopKRule"]


def moves_past(
    values: torch.Tensor, codes: torch.Tensor, threshold: float, cap: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The allowed moves against the sign of ``values`` where ``|values| > threshold``; the ``cap`` largest if more."""
    direction = torch.where(values.abs() > threshold, -torch.sign(values), torch.zeros_like(values)).to(torch.int8)
    allowed = move_allowed(codes, direction) & (direction != 0)
    if cap is not None and int(allowed.sum()) > cap:
        score = torch.where(allowed, values.abs(), torch.zeros_like(values))
        allowed = torch.zeros_like(allowed)
        allowed[torch.argsort(score, descending=True, stable=True)[:cap]] = True
    indices = allowed.nonzero().reshape(-1)
    return indices, direction[indices]


def cosine_scale(fraction: float, decay_to: float) -> float:
    """A cosine from 1 (``fraction`` 0) down to ``decay_to`` (``fraction`` 1)."""
    fraction = min(max(fraction, 0.0), 1.0)
    return decay_to + (1.0 - decay_to) * 0.5 * (1.0 + math.cos(math.pi * fraction))


class _Stateless:
    """A rule without state (nothing to checkpoint)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


class TopKRule(_Stateless):
    """The ``k`` allowed moves of largest ``|mean|`` (ties to the lower index)."""

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}.")
        self.k = k

    def __call__(self, mean: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_moves(mean, codes, self.k)


class BopRule:
    """Bop on the aggregated sparse gradient, with one fp16 momentum per code on the deciding rank.

    Args:
        offsets: Layer boundaries in the flat layout (``CodeLayout.offsets``: ``[0, n_0, n_0 + n_1, ...]``).
        gamma: EMA rate in (0, 1] (scaled by :attr:`gamma_scale`, e.g. for a decay schedule).
        threshold: ``|m|`` above which a code moves, as a fraction of the layer's rms gradient.
        reset: Factor applied to the momentum of a code that moved, in [0, 1].
        cap: At most this many moves per step (the largest ``|m|``); None: no cap.
    """

    def __init__(
        self, offsets: Sequence[int], gamma: float, threshold: float, reset: float = 0.0, cap: int | None = None
    ) -> None:
        check_bop_parameters(gamma, threshold, reset)
        if cap is not None and cap < 1:
            raise ValueError(f"cap must be >= 1 or None, got {cap}.")
        self.offsets = list(offsets)
        self.gamma, self.threshold, self.reset, self.cap = gamma, threshold, reset, cap
        self.gamma_scale = 1.0
        """Multiplies ``gamma`` (the strategy sets it from a cosine decay over the run)."""
        self.momentum = torch.zeros(self.offsets[-1], dtype=torch.float16)

    def __call__(self, mean: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, codes = mean.reshape(-1).float().cpu(), codes.reshape(-1).cpu()
        normalized = torch.zeros_like(mean)
        for lo, hi in zip(self.offsets[:-1], self.offsets[1:], strict=True):
            part = mean[lo:hi]
            sent = part != 0
            if bool(sent.any()):
                rms = part[sent].pow(2).mean().sqrt().clamp(min=1e-30)
                normalized[lo:hi] = part / rms
        gamma = self.gamma * self.gamma_scale
        m = ((1.0 - gamma) * self.momentum.float() + gamma * normalized).to(torch.float16).float()
        indices, directions = moves_past(m, codes, self.threshold, self.cap)
        if self.reset != 1.0:
            m[indices] = m[indices] * self.reset
        self.momentum = m.to(torch.float16)
        return indices, directions

    def set_progress(self, fraction: float, decay_to: float) -> None:
        """Cosine decay of ``gamma`` from 1x to ``decay_to`` x as the run goes from 0 to 1."""
        self.gamma_scale = cosine_scale(fraction, decay_to)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"momentum": self.momentum.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        momentum = state.get("momentum")
        if momentum is None or momentum.numel() != self.momentum.numel():
            raise ValueError(
                f"BopRule: the checkpoint holds {0 if momentum is None else momentum.numel()} momenta, this layout "
                f"has {self.momentum.numel()} codes."
            )
        self.momentum = momentum.detach().to(torch.float16).cpu().clone()


class ThresholdRule(_Stateless):
    """Move the codes whose mean (over ranks) momentum passes ``threshold``, against its sign; at most ``cap``."""

    def __init__(self, threshold: float, cap: int | None = None) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold}.")
        self.threshold, self.cap = threshold, cap

    def __call__(self, mean: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return moves_past(mean.reshape(-1).float().cpu(), codes.reshape(-1).cpu(), self.threshold, self.cap)


class LocalBop:
    """One rank's Bop momentum over the flat codes: ``m = (1 - gamma) m + gamma g / rms_layer(g)``, fp16.

    Args:
        offsets: Layer boundaries in the flat layout.
        gamma: EMA rate in (0, 1] (times :attr:`gamma_scale`).
    """

    def __init__(self, offsets: Sequence[int], gamma: float) -> None:
        if not 0 < gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}.")
        self.offsets, self.gamma, self.gamma_scale = list(offsets), gamma, 1.0
        self.momentum = torch.zeros(self.offsets[-1], dtype=torch.float16)

    def update(self, grad: torch.Tensor) -> torch.Tensor:
        """Fold this rank's dense code gradient in; returns the new momentum (float32)."""
        grad = grad.reshape(-1).float().cpu()
        normalized = torch.empty_like(grad)
        for lo, hi in zip(self.offsets[:-1], self.offsets[1:], strict=True):
            part = grad[lo:hi]
            normalized[lo:hi] = part / part.pow(2).mean().sqrt().clamp(min=1e-30)
        gamma = self.gamma * self.gamma_scale
        self.momentum = ((1.0 - gamma) * self.momentum.float() + gamma * normalized).to(torch.float16)
        return self.momentum.float()

    def reset(self, indices: torch.Tensor) -> None:
        """The codes at ``indices`` moved: start their momentum over."""
        self.momentum[indices.cpu()] = 0

    def set_progress(self, fraction: float, decay_to: float) -> None:
        """Cosine decay of ``gamma`` from 1x to ``decay_to`` x as the run goes from 0 to 1."""
        self.gamma_scale = cosine_scale(fraction, decay_to)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"momentum": self.momentum.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        momentum = state["momentum"]
        if momentum.numel() != self.momentum.numel():
            raise ValueError(f"LocalBop: {momentum.numel()} momenta in the checkpoint, {self.momentum.numel()} codes.")
        self.momentum = momentum.detach().to(torch.float16).cpu().clone()
