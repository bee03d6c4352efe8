"""Sparse averaging of the fp parameters' gradients with error feedback (the seed's thresholded gradients, for the
biases, norms, embeddings and heads that stay in fp while the weights are flip codes).

Each rank adds its residual (what it did not send before) to its flat gradient, sends the ``density`` fraction with
the largest magnitude as a validated sparse list (:mod:`lightning_hetero.sparseflip.wire`), all-gathers the lists, and
every rank sums the decoded lists in rank order and divides by the world size, so every rank gets the same averaged
gradient bit for bit. The residual keeps exactly what this rank's decoded list did not carry (including the value
encoding's rounding), so nothing is lost, only delayed.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_hetero import comm
from lightning_hetero.comm.validation import validate_on_bad_payload
from lightning_hetero.sparseflip.sparse import all_gather_messages, decode_lists, mean_of_lists, select_sparse
from lightning_hetero.sparseflip.wire import encode_sparse

__all__ = ["SparseGradientAverage"]


class SparseGradientAverage:
    """Sparse, error-feedback average of one flat fp gradient over a process group.

    Args:
        numel: Length of the flat gradient.
        density: Fraction of the entries each rank sends per step, in (0, 1].
        encoding: Value encoding of the lists (``"fp32"``, ``"bf16"``, ...).
        label: Ledger label.
        group: Process group (default WORLD).
        on_bad_payload: ``"raise"``: a corrupt peer list raises
            :class:`~lightning_hetero.comm.validation.PeerPayloadError` on every rank; ``"drop"``: it is left out
            and the average is taken over the other ranks (logged, counted in ``dropped_payloads``).
    """

    def __init__(
        self,
        numel: int,
        density: float,
        encoding: str = "bf16",
        label: str = comm.INTER,
        group: Any = None,
        on_bad_payload: str = "raise",
    ) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}.")
        self.on_bad_payload = validate_on_bad_payload(type(self).__name__, on_bad_payload)
        self.dropped_payloads = 0
        self.numel, self.density, self.encoding, self.label, self.group = numel, density, encoding, label, group
        self.residual = torch.zeros(numel, dtype=torch.float32)

    def _world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.group), dist.get_world_size(self.group)
        return 0, 1

    def average(self, grad: torch.Tensor) -> torch.Tensor:
        """The group's sparse average of ``grad`` (flat, any device; returned on ``grad``'s device, float32)."""
        if grad.numel() != self.numel:
            raise ValueError(f"the gradient has {grad.numel()} entries, expected {self.numel}.")
        corrected = grad.detach().reshape(-1).float().cpu() + self.residual
        indices, values = select_sparse(corrected, density=self.density)
        message = encode_sparse(indices, values, self.numel, self.encoding)
        rank, n = self._world()
        messages = (
            [message]
            if n == 1
            else all_gather_messages(
                message, n, self.numel, self.encoding, self.on_bad_payload, label=self.label, group=self.group
            )
        )
        dropped_before = self.dropped_payloads
        lists = decode_lists(messages, self.numel, self.encoding, self.on_bad_payload, self)
        contributors = max(n - (self.dropped_payloads - dropped_before), 1)  # the mean of the lists kept
        # Checked (finite, bounded) before it reaches a gradient or the residual; the same bytes on every rank give
        # the same verdict, so a refused combination raises on all of them.
        mean = mean_of_lists(lists, self.numel, contributors)
        sent_indices, sent_values = lists[rank]
        self.residual = corrected.clone()
        self.residual.index_add_(0, sent_indices, -sent_values)
        return mean.to(grad.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's residual."""
        return {"residual": self.residual.clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore this rank's residual (a size mismatch restarts from zero, with a warning)."""
        residual = state.get("residual")
        if residual is None or residual.numel() != self.numel:
            warnings.warn(
                "SparseGradientAverage: no matching residual in the checkpoint; starting from zero.", stacklevel=2
            )
            self.residual = torch.zeros(self.numel, dtype=torch.float32)
            return
        self.residual = residual.detach().float().cpu().clone()
