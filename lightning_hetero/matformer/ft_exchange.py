"""Tiered MatFormer's gradient exchange in the fault-tolerant (spot worker) mode: the per-region mean over a quorum.

In the mode (``docs/spot.md``, "MatFormer nodes") every node is one replica group of one rank holding the **full**
model (masked, never sliced, so any node can heal any other); its tier only decides which FFN prefix it trains. Each
step every participant of the torchft quorum sends one payload through
:meth:`~lightning_hetero.ft.replicas.FaultTolerantReplica.gather_bytes` (an authenticated all-gather, participant
order): its FFN widths and its whole gradient. Every participant then forms the same mean from the same bytes in the
same order, so the replicas stay bit-identical:

- a non-FFN parameter: the mean over all participants;
- an FFN parameter of layer ``l``, neuron ``j`` of its hidden axis: the mean over the participants whose width in
  layer ``l`` exceeds ``j`` (the nested regions of :mod:`~lightning_hetero.matformer.regions`, per neuron); a neuron
  no participant trains gets a zero gradient.

The wire (explicit, no pickle; little-endian): a header of int32 words ``[MAGIC, VERSION, layers, elements,
width_0 ... width_{layers-1}]`` followed by the gradient as float32, every parameter in :func:`gradient_specs` order,
the hidden units beyond the sender's width zeroed. The payload is the dense gradient on every node (the all-gather
needs one size everywhere): ``S = 4 (4 + layers) + 4 P`` bytes for ``P`` trainable elements, and each node sends
``(n - 1) (S + 32)`` bytes per step to ``n`` participants (the ledger's all-gather rule; 32 bytes of HMAC tag per slot).

A payload is refused as a whole (:class:`~lightning_hetero.comm.validation.PeerPayloadError`, naming the
participant and the field) when its header or size is not this node's, a width is outside ``[1, h]``, a value is
NaN/Inf or above :data:`~lightning_hetero.comm.validation.MAX_PEER_MAGNITUDE`, or it holds a non-zero gradient beyond
its own width (a tier that does not match its gradient); the runtime then fails the quorum's commit, so nothing is
applied anywhere and the step is tried again.

Framework-free: no Lightning, no torchft import (the caller passes the gather).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError
from lightning_hetero.matformer.types import FFNParameter

__all__ = [
    "MAGIC",
    "VERSION",
    "Contribution",
    "GradientSpec",
    "decode_payload",
    "encode_payload",
    "exchange_gradients",
    "gradient_specs",
    "payload_bytes",
    "region_mean",
]

MAGIC = 0x4D46_4654  # "MFFT": a MatFormer fault-tolerant gradient payload
VERSION = 1
_HEADER_WORDS = 4


@dataclass(frozen=True)
class GradientSpec:
    """One trainable parameter as it travels: its name, full shape, and (FFN parameters) hidden axis and layer."""

    name: str
    shape: tuple[int, ...]
    axis: int | None = None
    layer: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Contribution:
    """One participant's decoded payload: its width in every FFN layer and its flat float32 gradient."""

    widths: tuple[int, ...]
    gradient: torch.Tensor


def gradient_specs(shapes: Mapping[str, Sequence[int]], ffn_params: Sequence[FFNParameter]) -> list[GradientSpec]:
    """The wire order: every trainable parameter (full shape) sorted by name, FFN ones with their axis and layer.

    Raises:
        ValueError: An FFN parameter that is not in ``shapes`` or whose hidden axis is not full size.
    """
    ffn = {param.name: param for param in ffn_params}
    missing = sorted(set(ffn) - set(shapes))
    if missing:
        raise ValueError(f"FFN parameters {missing[:3]} are not trainable parameters of the module.")
    specs = []
    for name in sorted(shapes):
        shape = tuple(int(size) for size in shapes[name])
        param = ffn.get(name)
        if param is not None and shape[param.axis] != param.full_size:
            raise ValueError(
                f"{name}: shape {shape} is not full size {param.full_size} on axis {param.axis}; the fault-tolerant "
                "mode keeps every FFN at full width (settings.slice_weights=False)."
            )
        specs.append(GradientSpec(name, shape, param.axis if param else None, param.layer if param else None))
    return specs


def payload_bytes(specs: Sequence[GradientSpec], layers: int) -> int:
    """Size ``S`` of one payload: the header (``4 + layers`` int32 words) and the float32 gradient."""
    return 4 * (_HEADER_WORDS + layers) + 4 * sum(spec.numel for spec in specs)


def encode_payload(
    widths: Sequence[int], grads: Mapping[str, torch.Tensor], specs: Sequence[GradientSpec]
) -> torch.Tensor:
    """This node's payload (1-D uint8): header, then every gradient as float32 with the units beyond its width zeroed.

    Args:
        widths: This node's width in every FFN layer (index = layer).
        grads: Full-shape gradients by name (missing ones count as zeros).
        specs: The wire order (:func:`gradient_specs`).
    """
    total = sum(spec.numel for spec in specs)
    header = torch.tensor([MAGIC, VERSION, len(widths), total, *widths], dtype=torch.int32)
    flat = torch.zeros(total, dtype=torch.float32)
    offset = 0
    for spec in specs:
        view = flat[offset : offset + spec.numel].view(spec.shape)
        grad = grads.get(spec.name)
        if grad is not None:
            view.copy_(grad.detach().reshape(spec.shape))
            if spec.axis is not None:
                width = widths[spec.layer]  # type: ignore[index]
                view.narrow(spec.axis, width, spec.shape[spec.axis] - width).zero_()
        offset += spec.numel
    return torch.cat([header.view(torch.uint8), flat.view(torch.uint8)])


def _refuse(participant: int, field: str, message: str) -> PeerPayloadError:
    return PeerPayloadError(
        f"MatFormer fault-tolerant exchange: participant {participant}'s {field} {message}; the step is discarded.",
        participant,
        field,
    )


def decode_payload(
    payload: torch.Tensor, specs: Sequence[GradientSpec], full_sizes: Sequence[int], participant: int
) -> Contribution:
    """Check one participant's payload against this node's model and return its widths and gradient.

    Args:
        payload: The participant's bytes (1-D uint8), as :func:`encode_payload` wrote them.
        specs: This node's wire order.
        full_sizes: The full FFN size ``h`` of every layer.
        participant: Its index in the quorum (named in errors).

    Raises:
        PeerPayloadError: See the module docstring (the header, the size, a width, a value, the tier's zeros).
    """
    layers, total = len(full_sizes), sum(spec.numel for spec in specs)
    expected = payload_bytes(specs, layers)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
        raise _refuse(participant, "payload", f"has {payload.numel()} bytes, this node's model needs {expected}")
    raw = payload.detach().cpu().contiguous()
    header_size = 4 * (_HEADER_WORDS + layers)
    header = raw[:header_size].view(torch.int32).tolist()
    if header[:_HEADER_WORDS] != [MAGIC, VERSION, layers, total]:
        raise _refuse(
            participant,
            "header",
            f"is {header[:_HEADER_WORDS]}, expected [magic, version {VERSION}, {layers} FFN layers, {total} elements]",
        )
    widths = tuple(header[_HEADER_WORDS:])
    for layer, (width, full) in enumerate(zip(widths, full_sizes, strict=True)):
        if not 1 <= width <= full:
            raise _refuse(participant, f"header.widths[{layer}]", f"is {width}, outside [1, {full}]")
    gradient = raw[header_size:].view(torch.float32)
    if gradient.numel():
        low, high = torch.aminmax(gradient)
        largest = max(-float(low), float(high))
        if not math.isfinite(largest):
            raise _refuse(participant, "gradient", "holds NaN/Inf")
        if largest > MAX_PEER_MAGNITUDE:
            bound = f"{largest:.3g} > {MAX_PEER_MAGNITUDE:.3g}"
            raise _refuse(participant, "gradient", f"holds a value of magnitude {bound}")
    offset = 0
    for spec in specs:
        if spec.axis is not None:
            width = widths[spec.layer]  # type: ignore[index]
            view = gradient[offset : offset + spec.numel].view(spec.shape)
            tail = view.narrow(spec.axis, width, spec.shape[spec.axis] - width)
            if tail.numel() and bool(torch.any(tail != 0)):
                raise _refuse(
                    participant,
                    f"gradient[{spec.name}]",
                    f"is non-zero beyond its width {width} (layer {spec.layer}): its tier does not match its gradient",
                )
        offset += spec.numel
    return Contribution(widths, gradient)


def region_mean(
    contributions: Sequence[Contribution], specs: Sequence[GradientSpec], full_sizes: Sequence[int]
) -> torch.Tensor:
    """The per-region mean over the contributions (flat float32, wire order), summed in contribution order.

    Each contribution is already zero beyond its own width (:func:`decode_payload` checks it), so the sum over all of
    them equals the sum over each neuron's trainers; it is divided per neuron by their count (1 where nobody trained
    it: the sum is 0 there). Every node calls this with the same contributions in the same order: the same bits.
    """
    if not contributions:
        raise ValueError("region_mean needs at least one contribution.")
    total = contributions[0].gradient.clone()
    for contribution in contributions[1:]:
        total += contribution.gradient
    counts = {
        layer: torch.tensor(
            [max(sum(c.widths[layer] > j for c in contributions), 1) for j in range(full)], dtype=torch.float32
        )
        for layer, full in enumerate(full_sizes)
    }
    offset = 0
    for spec in specs:
        view = total[offset : offset + spec.numel].view(spec.shape)
        if spec.axis is None:
            view.div_(len(contributions))
        else:
            shape = [1] * len(spec.shape)
            shape[spec.axis] = -1
            view.div_(counts[spec.layer].view(shape))  # type: ignore[index]
        offset += spec.numel
    return total


def exchange_gradients(
    gather: Callable[[torch.Tensor], list[torch.Tensor]],
    widths: Sequence[int],
    grads: Mapping[str, torch.Tensor],
    specs: Sequence[GradientSpec],
    full_sizes: Sequence[int],
) -> list[tuple[int, ...]]:
    """Replace ``grads`` in place by the per-region mean over the quorum's participants; return every participant's
    widths (participant order).

    Args:
        gather: Every participant's payload in participant order (``FaultTolerantReplica.gather_bytes``).
        widths: This node's width in every FFN layer.
        grads: This node's full-shape gradients by name, written in place (every spec's name must be present).
        specs: The wire order (:func:`gradient_specs`).
        full_sizes: The full FFN size of every layer.

    Raises:
        PeerPayloadError: A participant's payload was refused; ``grads`` are unchanged.
    """
    payload = encode_payload(widths, grads, specs)
    contributions = [
        decode_payload(slot, specs, full_sizes, participant) for participant, slot in enumerate(gather(payload))
    ]
    mean = region_mean(contributions, specs, full_sizes)
    offset = 0
    with torch.no_grad():
        for spec in specs:
            grad = grads[spec.name]
            grad.copy_(mean[offset : offset + spec.numel].view(spec.shape).to(grad.device, grad.dtype))
            offset += spec.numel
    return [contribution.widths for contribution in contributions]
