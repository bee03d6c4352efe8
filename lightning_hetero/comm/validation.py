"""Checks on bytes that came from another process: one error type and one policy for every strategy.

A peer can send a payload that must not be applied: a coefficient index outside its block, a wrong length, NaN/Inf
values, a JSON document of the wrong shape or size, or a payload built from another model schema. Every decoder that
consumes peer bytes raises :class:`PeerPayloadError` (a ``ValueError``) for such input, naming the peer and the
piece, instead of applying it or crashing. A strategy's ``on_bad_payload`` argument chooses what happens next:

- ``"raise"`` (default): the error propagates and training stops with the message;
- ``"drop"``: the offending contribution is left out (logged as a warning on the ``lightning_hetero`` logger and
  counted), and training goes on. Every rank sees the same bytes, so every rank drops the same contribution and the
  replicas stay identical.

The rule every decoder of peer bytes keeps (one place per wire format enforces it): it returns values that are
finite, of magnitude at most :data:`MAX_PEER_MAGNITUDE`, in range and of the announced layout, or it raises
:class:`PeerPayloadError` naming the peer and the field. Nothing else escapes a decoder (no RuntimeError,
IndexError, OverflowError, MemoryError or a third-party parse error): :func:`peer_decoding` turns those into a
:class:`PeerPayloadError`. The magnitude bound keeps sums of any realistic number of peers' values finite in fp32
(``2**64`` per value, fp32 overflows past ``2**128``); combined results are checked again with :func:`check_values`
before anything touches parameters or optimizer state.

Nothing here unpickles anything: payloads are flat ``uint8`` tensors decoded with explicit codecs, or UTF-8 JSON.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Literal

import torch

__all__ = [
    "BAD_PAYLOAD_POLICIES",
    "MAX_PEER_MAGNITUDE",
    "BadPayloadPolicy",
    "PeerPayloadError",
    "check_announced_size",
    "check_finite",
    "check_index_range",
    "check_length",
    "check_unique_indices",
    "check_values",
    "peer_decoding",
    "report_dropped",
    "validate_on_bad_payload",
]

log = logging.getLogger("lightning_hetero.peer_payloads")

BadPayloadPolicy = Literal["raise", "drop"]
"""What a strategy does with a peer payload that fails validation."""
BAD_PAYLOAD_POLICIES: tuple[str, ...] = ("raise", "drop")
"""Accepted values of the strategies' ``on_bad_payload`` argument."""
MAX_PEER_MAGNITUDE: float = 2.0**64
"""Largest absolute value a decoded peer value may have. Far above any gradient, momentum, update or activation a
healthy run produces (fp16's whole range is below 2**16), and small enough that the sum of up to 2**60 such values
stays finite in fp32 (max ~2**128): a peer cannot overflow a combination with values that are finite alone."""


class PeerPayloadError(ValueError):
    """A payload received from another process cannot be applied (bad index, length, value, schema or JSON).

    Attributes:
        peer: The sending rank when known (rank in the exchanging group), else None.
        field: The piece of the payload that failed (e.g. ``"values"``, ``"scale"``, ``"header.numel"``), when known.
    """

    def __init__(self, message: str, peer: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.field = field


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
            what,
        )


def check_index_range(indices: torch.Tensor, size: int, *, peer: int | None = None, what: str = "payload") -> None:
    """Raise :class:`PeerPayloadError` unless every index lies in ``[0, size)``."""
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= size):
        bad = int(indices.max()) if int(indices.max()) >= size else int(indices.min())
        raise PeerPayloadError(
            f"{_source(peer, what)} holds index {bad}, outside [0, {size}); refusing to apply it.", peer, what
        )


def check_finite(values: torch.Tensor, *, peer: int | None = None, what: str = "payload") -> None:
    """Raise :class:`PeerPayloadError` if ``values`` (floating point) holds NaN or Inf."""
    if values.is_floating_point() and values.numel() and not bool(torch.isfinite(values).all()):
        raise PeerPayloadError(
            f"{_source(peer, what)} holds non-finite values (NaN/Inf); refusing to apply them (a diverged or corrupt"
            " peer: check its loss, or restart from the last checkpoint).",
            peer,
            what,
        )


def check_values(
    values: torch.Tensor,
    *,
    peer: int | None = None,
    what: str = "payload",
    bound: float = MAX_PEER_MAGNITUDE,
) -> None:
    """Raise :class:`PeerPayloadError` unless every value of ``values`` is finite and of magnitude at most ``bound``.

    Use it on what a decoder returns and again on a combination of several peers' values (a sum of finite values can
    overflow). Integer tensors are only checked against the bound.
    """
    if not values.numel():
        return
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        check_finite(values, peer=peer, what=what)
    largest = float(values.detach().abs().max())
    if largest > bound:
        raise PeerPayloadError(
            f"{_source(peer, what)} holds a value of magnitude {largest:.3g}, above the bound {bound:.3g} that no "
            "healthy run reaches; refusing to apply it (a corrupt or hostile peer).",
            peer,
            what,
        )


def check_announced_size(
    announced: object, limit: int, *, peer: int | None = None, what: str = "size", minimum: int = 0
) -> int:
    """Return ``announced`` as an int if it is an integer in ``[minimum, limit]``, else raise :class:`PeerPayloadError`.

    Call it on every size a peer announces before allocating anything for it, with ``limit`` taken from what the
    receiver's own layout allows (never from the peer).
    """
    if isinstance(announced, bool) or not isinstance(announced, int | torch.Tensor):
        raise PeerPayloadError(f"{_source(peer, what)} is {announced!r}, not an integer; refusing it.", peer, what)
    if isinstance(announced, torch.Tensor):
        if announced.numel() != 1 or announced.is_floating_point() or announced.is_complex():
            raise PeerPayloadError(f"{_source(peer, what)} is not one integer; refusing it.", peer, what)
        announced = int(announced.item())
    if not minimum <= announced <= limit:
        raise PeerPayloadError(
            f"{_source(peer, what)} announces {announced}, outside [{minimum}, {limit}] (what this rank's own layout "
            "allows); refusing it before allocating anything.",
            peer,
            what,
        )
    return int(announced)


def check_unique_indices(indices: torch.Tensor, *, peer: int | None = None, what: str = "indices") -> None:
    """Raise :class:`PeerPayloadError` if a 1-D (or per-row, 2-D) index tensor repeats an index.

    An honest top-k never repeats one; a repeated index would be applied twice (scatter-add) or ambiguously
    (scatter), so it is refused like an out-of-range one.
    """
    if indices.numel() < 2:
        return
    rows = indices.reshape(-1, indices.shape[-1]) if indices.dim() > 1 else indices.reshape(1, -1)
    ordered = rows.sort(dim=-1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise PeerPayloadError(f"{_source(peer, what)} repeats an index; refusing to apply it.", peer, what)


@contextlib.contextmanager
def peer_decoding(peer: int | None = None, what: str = "payload") -> Iterator[None]:
    """Decode peer bytes inside this block: any error other than :class:`PeerPayloadError` becomes one.

    A malformed payload must never escape as a RuntimeError from a tensor view, an IndexError, an OverflowError, a
    MemoryError from an allocation or a parser's own exception type: the caller's ``on_bad_payload`` policy can only
    act on :class:`PeerPayloadError`. A bug in our own code raised here still carries its original message and
    traceback (as ``__cause__``).
    """
    try:
        yield
    except PeerPayloadError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as error:  # noqa: BLE001 - the point: nothing but PeerPayloadError leaves a decoder
        raise PeerPayloadError(
            f"{_source(peer, what)} could not be decoded ({type(error).__name__}: {error}); refusing it.", peer, what
        ) from error


def report_dropped(error: PeerPayloadError, action: str, counter: Any = None) -> None:
    """Log a dropped payload (``on_bad_payload="drop"``) as a warning: the error and what was done instead."""
    log.warning("dropped a corrupt peer payload (%s): %s", action, error)
    if counter is not None and hasattr(counter, "dropped_payloads"):
        counter.dropped_payloads += 1
