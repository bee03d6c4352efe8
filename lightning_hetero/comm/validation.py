"""Checks on bytes that came from another process: one error type and one policy for every strategy.

A peer can send a payload that must not be applied: a coefficient index outside its block, a wrong length, NaN/Inf
values, a JSON document of the wrong shape or size, or a payload built from another model schema. Every decoder that
consumes peer bytes raises :class:`PeerPayloadError` (a ``ValueError``) for such input, naming the peer and the
piece, instead of applying it or crashing. A strategy's ``on_bad_payload`` argument chooses what happens next:

- ``"raise"`` (default): the error propagates and training stops with the message;
- ``"drop"``: the offending contribution is left out (logged as a warning on the ``lightning_hetero`` logger and
  counted), and training goes on. Every rank sees the same bytes, so every rank drops the same contribution and the
  replicas stay identical.

Nothing here unpickles anything: payloads are flat ``uint8`` tensors decoded with explicit codecs, or UTF-8 JSON.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

__all__ = [
    "BAD_PAYLOAD_POLICIES",
    "BadPayloadPolicy",
    "PeerPayloadError",
    "check_finite",
    "check_index_range",
    "check_length",
    "report_dropped",
    "validate_on_bad_payload",
]

log = logging.getLogger("lightning_hetero.peer_payloads")

BadPayloadPolicy = Literal["raise", "drop"]
"""What a strategy does with a peer payload that fails validation."""
BAD_PAYLOAD_POLICIES: tuple[str, ...] = ("raise", "drop")
"""Accepted values of the strategies' ``on_bad_payload`` argument."""


class PeerPayloadError(ValueError):
    """A payload received from another process cannot be applied (bad index, length, value, schema or JSON).

    Attributes:
        peer: The sending rank when known (rank in the exchanging group), else None.
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


def validate_on_bad_payload(owner: str, value: object) -> str:
    """Return ``value`` if it is ``"raise"`` or ``"drop"``, else raise a ValueError naming the argument and the fix."""
    if value not in BAD_PAYLOAD_POLICIES:
        raise ValueError(
            f"{owner}(on_bad_payload={value!r}): use 'raise' (stop on a corrupt peer payload, the default) or 'drop'"
            " (leave the payload out, log a warning and go on)."
        )
    return str(value)


def _source(peer: int | None, what: str) -> str:
    return f"{what} from rank {peer}" if peer is not None else what


def check_length(data: torch.Tensor, expected: int, *, peer: int | None = None, what: str = "payload") -> None:
    """Raise :class:`PeerPayloadError` unless ``data`` holds exactly ``expected`` elements."""
    if data.numel() != expected:
        raise PeerPayloadError(
            f"{_source(peer, what)} has {data.numel()} elements, expected {expected}; refusing it (truncated or "
            "built by a differently configured peer).",
            peer,
        )


def check_index_range(indices: torch.Tensor, size: int, *, peer: int | None = None, what: str = "payload") -> None:
    """Raise :class:`PeerPayloadError` unless every index lies in ``[0, size)``."""
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= size):
        bad = int(indices.max()) if int(indices.max()) >= size else int(indices.min())
        raise PeerPayloadError(
            f"{_source(peer, what)} holds index {bad}, outside [0, {size}); refusing to apply it.", peer
        )


def check_finite(values: torch.Tensor, *, peer: int | None = None, what: str = "payload") -> None:
    """Raise :class:`PeerPayloadError` if ``values`` (floating point) holds NaN or Inf."""
    if values.is_floating_point() and values.numel() and not bool(torch.isfinite(values).all()):
        raise PeerPayloadError(
            f"{_source(peer, what)} holds non-finite values (NaN/Inf); refusing to apply them (a diverged or corrupt"
            " peer: check its loss, or restart from the last checkpoint).",
            peer,
        )


def report_dropped(error: PeerPayloadError, action: str, counter: Any = None) -> None:
    """Log a dropped payload (``on_bad_payload="drop"``) as a warning: the error and what was done instead."""
    log.warning("dropped a corrupt peer payload (%s): %s", action, error)
    if counter is not None and hasattr(counter, "dropped_payloads"):
        counter.dropped_payloads += 1
