"""Forward-only activation links between decoupled greedy (DGL) stages: counted, encoded, flow-controlled.

Stage ``s`` sends its detached block output to stage ``s + 1`` and never receives anything back (no gradients, so no
backward traffic and no pipeline bubble). One :class:`ActivationLink` joins two neighbouring ranks of a replica; every
byte goes through :mod:`lightning_hetero.comm` under the label :data:`~lightning_hetero.comm.PIPELINE`.

Wire format of one message (per training step and boundary):

- **synchronous** mode: the activations only, encoded by a :class:`~lightning_hetero.subspace.codec.BoundaryCodec`
  (``fp32``: ``B*S*H*4`` bytes for a ``(B, S, H)`` hidden state; ``bf16``: ``*2``; ``int8``: ``B*S*(4*ceil(H/4)+4)``).
  Both ends read the same batch from their own data loader, so the receiver knows the batch; the per-sample shape
  is sent once per new input shape as a :data:`HEADER_LENGTH`-int64 header (64 bytes), then never again.
- **asynchronous** mode: a 64-byte header before every payload (the step that produced the batch, the batch size and
  the per-sample shape), because the receiver may be training on another step than the sender's.

Labels and attention masks never travel: every stage reads them from its own copy of the batch (asynchronous mode
keeps its recent batches in a :class:`~lightning_hetero.layerwise.replay.BatchRing`). Nothing here imports Lightning.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_hetero import comm
from lightning_hetero.subspace.codec import BoundaryCodec

__all__ = ["HEADER_LENGTH", "ActivationLink", "batch_signature", "header_bytes"]

HEADER_LENGTH = 8
"""int64 entries of a header: ``[step, batch, ndim, *sample_shape]`` padded with -1 (at most 5 sample dims)."""
_MAX_SAMPLE_DIMS = HEADER_LENGTH - 3


def header_bytes() -> int:
    """Bytes of one header message."""
    return HEADER_LENGTH * 8


def batch_signature(batch: Any) -> tuple:
    """The non-batch shapes and dtypes of every tensor in ``batch`` (equal batches of a loader share it)."""
    if isinstance(batch, Tensor):
        return (tuple(batch.shape[1:]), str(batch.dtype))
    if isinstance(batch, Mapping):
        return tuple((key, batch_signature(batch[key])) for key in sorted(batch, key=str))
    if isinstance(batch, (list, tuple)):
        return tuple(batch_signature(item) for item in batch)
    return ()


class ActivationLink:
    """One direction of one boundary: ``send`` on stage ``s``, ``receive``/``poll`` on stage ``s + 1``.

    Args:
        peer: Global rank at the other end.
        codec: ``"fp32"``, ``"bf16"`` or ``"int8"`` (lossy, per-token scale) for the activations.
        tag: Message tag of the payloads (``tag + 1`` is used for headers); training and evaluation use different
            tags so their messages never match each other.
        asynchronous: Send a header with every payload (see the module docstring).
        max_in_flight: Sends that may be outstanding before :meth:`send` waits for the oldest (bounds the memory a
            fast sender spends on a slow link, and how far ahead of its receiver it can run).
        label: Ledger label.
    """

    def __init__(
        self,
        peer: int,
        codec: str = "fp32",
        tag: int = 10,
        asynchronous: bool = False,
        max_in_flight: int = 2,
        label: str = comm.PIPELINE,
    ) -> None:
        BoundaryCodec(codec, 1)  # validates the name
        self.peer, self.codec_name, self.tag, self.asynchronous = peer, codec, tag, asynchronous
        self.max_in_flight = max(1, int(max_in_flight))
        self.label = label
        self._pending_sends: deque[list[tuple[Any, Tensor]]] = deque()
        self._sample_shapes: dict[tuple, tuple[int, ...]] = {}
        self._in_flight: dict[str, Any] | None = None  # asynchronous receive in progress
        self.messages_sent = 0
        self.messages_received = 0

    # ------------------------------------------------------------------------------------------------ sender
    def send(self, activations: Tensor, step: int, signature: tuple = ()) -> None:
        """Encode and start sending ``activations`` (detached) produced at ``step`` for a batch of ``signature``."""
        values = activations.detach()
        if values.dim() - 1 > _MAX_SAMPLE_DIMS:
            raise ValueError(f"ActivationLink: activations of {values.dim()} dims; at most {_MAX_SAMPLE_DIMS + 1}.")
        sample = tuple(values.shape[1:])
        works: list[tuple[Any, Tensor]] = []
        if self.asynchronous or signature not in self._sample_shapes:
            self._sample_shapes[signature] = sample
            works.append(self._start(self._header(step, values.shape[0], sample, values.device), self.tag + 1))
        elif self._sample_shapes[signature] != sample:
            raise RuntimeError(
                f"ActivationLink: batches of the same input shape gave activations of shapes "
                f"{self._sample_shapes[signature]} and {sample}; the receiver cannot size its buffer."
            )
        codec = BoundaryCodec(self.codec_name, sample[-1])
        works.append(self._start(codec.encode(values).contiguous(), self.tag))
        self._pending_sends.append(works)
        self.messages_sent += 1
        while len(self._pending_sends) > self.max_in_flight:
            for work, _ in self._pending_sends.popleft():
                work.wait()

    def _start(self, payload: Tensor, tag: int) -> tuple[Any, Tensor]:
        # The payload stays referenced until its send completes.
        return comm.isend(payload, self.peer, label=self.label, tag=tag), payload

    def flush_sends(self) -> None:
        """Wait for every outstanding send."""
        while self._pending_sends:
            for work, _ in self._pending_sends.popleft():
                work.wait()

    @staticmethod
    def _header(step: int, batch: int, sample: tuple[int, ...], device: torch.device) -> Tensor:
        values = [step, batch, len(sample), *sample] + [-1] * (_MAX_SAMPLE_DIMS - len(sample))
        return torch.tensor(values, dtype=torch.int64, device=device)

    # ------------------------------------------------------------------------------------------------ receiver
    def receive(self, batch_size: int, signature: tuple, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Synchronous mode: block until the next activations arrive; returns them decoded to ``dtype``."""
        if self.asynchronous:
            raise RuntimeError("ActivationLink.receive is the synchronous path; use poll/wait_next when asynchronous.")
        sample = self._sample_shapes.get(signature)
        if sample is None:
            header = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=device)
            comm.recv(header, self.peer, label=self.label, tag=self.tag + 1)
            _, sent_batch, sample = self._parse(header)
            if sent_batch != batch_size:
                raise RuntimeError(
                    f"ActivationLink: the previous stage sent a batch of {sent_batch} samples, this stage read "
                    f"{batch_size}. Every stage of a replica must read the same batches (same data loader and seed)."
                )
            self._sample_shapes[signature] = sample
        wire = self._wire_buffer(batch_size, sample, device)
        comm.recv(wire, self.peer, label=self.label, tag=self.tag)
        self.messages_received += 1
        return BoundaryCodec(self.codec_name, sample[-1]).decode(wire, dtype)

    @staticmethod
    def _parse(header: Tensor) -> tuple[int, int, tuple[int, ...]]:
        values = header.tolist()
        ndim = int(values[2])
        return int(values[0]), int(values[1]), tuple(int(v) for v in values[3 : 3 + ndim])

    def _wire_buffer(self, batch: int, sample: tuple[int, ...], device: torch.device) -> Tensor:
        codec = BoundaryCodec(self.codec_name, sample[-1])
        return torch.empty((batch, *sample[:-1], codec.wire_width), dtype=codec.wire_dtype, device=device)

    def poll(
        self, limit: int, device: torch.device, dtype: torch.dtype, block: bool = False
    ) -> list[tuple[int, Tensor]]:
        """Asynchronous mode: the ``(step, activations)`` messages completed so far, in order.

        Keeps one receive posted (header, then payload) while fewer than ``limit`` messages have arrived in all (so
        nothing is left posted once the sender is done). ``block=True`` waits until at least one message completes.
        """
        done: list[tuple[int, Tensor]] = []
        while True:
            if self._in_flight is None:
                if self.messages_received >= limit:
                    return done
                header = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=device)
                work = comm.irecv(header, self.peer, label=self.label, tag=self.tag + 1)
                self._in_flight = {"header": header, "work": work}
            state = self._in_flight
            if not state["work"].is_completed():
                if done or not block:
                    return done
                state["work"].wait()
            if "wire" not in state:  # the header arrived: post the payload
                step, batch, sample = self._parse(state["header"])
                wire = self._wire_buffer(batch, sample, device)
                state.update(step=step, sample=sample, wire=wire)
                state["work"] = comm.irecv(wire, self.peer, label=self.label, tag=self.tag)
                continue
            self._in_flight = None
            self.messages_received += 1
            codec = BoundaryCodec(self.codec_name, state["sample"][-1])
            done.append((state["step"], codec.decode(state["wire"], dtype)))

    def drain_until(self, count: int, device: torch.device, dtype: torch.dtype) -> list[tuple[int, Tensor]]:
        """Asynchronous mode: receive until ``count`` messages in all have arrived (blocking); returns the new ones."""
        done: list[tuple[int, Tensor]] = []
        while self.messages_received < count:
            done += self.poll(count, device, dtype, block=True)
        return done
