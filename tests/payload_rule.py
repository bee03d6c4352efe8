"""The decoder rule of docs/reliability.md ("Hostile and corrupt input"), as one assertion every fuzz test uses.

A decoder of peer bytes either raises :class:`~lightning_hetero.comm.validation.PeerPayloadError` (with the peer
when the decoder knows it) or returns values that are finite, of magnitude at most ``MAX_PEER_MAGNITUDE``, and of the
announced layout. Any other exception is a failure of the rule, whatever its type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError


def _tensors(result: Any) -> Iterable[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        yield result
    elif isinstance(result, dict):
        for value in result.values():
            yield from _tensors(value)
    elif isinstance(result, list | tuple):
        for value in result:
            yield from _tensors(value)


def assert_decoder_rule(
    decode: Callable[[], Any],
    *,
    peer: int | None = None,
    check_layout: Callable[[Any], None] | None = None,
    bound: float = MAX_PEER_MAGNITUDE,
) -> Any:
    """Run ``decode()`` and assert the rule. Returns the decoded result, or None when it was refused.

    Args:
        decode: A zero-argument call that decodes one payload.
        peer: The sending rank the decoder was told, checked against the error's ``peer`` when given.
        check_layout: Asserts the announced layout (shapes, index ranges) of an accepted result.
        bound: The magnitude bound for accepted floating-point values.
    """
    try:
        result = decode()
    except PeerPayloadError as error:
        if peer is not None:
            assert error.peer == peer, f"PeerPayloadError names peer {error.peer}, expected {peer}: {error}"
        return None
    for tensor in _tensors(result):
        if tensor.is_floating_point() and tensor.numel():
            assert bool(torch.isfinite(tensor).all()), "an accepted payload decoded to NaN/Inf"
            assert float(tensor.abs().max()) <= bound, "an accepted payload decoded above the magnitude bound"
    if check_layout is not None:
        check_layout(result)
    return result


def gather_outcome(receive: Callable[[], Any], summarize: Callable[[Any], Any]) -> tuple[Any, ...]:
    """Run one receiving collective and record its outcome as plain data a spawned rank can return.

    ``("accepted", summarize(result))``, ``("refused", peer, field, message)`` for a :class:`PeerPayloadError`, or
    ``("escaped", type name, message)`` for anything else (which breaks the rule: tests assert it never happens).
    """
    try:
        return ("accepted", summarize(receive()))
    except PeerPayloadError as error:
        return ("refused", error.peer, error.field, str(error))
    except Exception as error:  # noqa: BLE001 - recorded, so the test can name what escaped
        return ("escaped", type(error).__name__, str(error))
