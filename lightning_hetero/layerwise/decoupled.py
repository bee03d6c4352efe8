"""Forward-only activation links between decoupled greedy (DGL) stages: counted, encoded, flow-controlled.

Stage ``s`` sends its detached block output to stage ``s + 1`` and never receives anything back (no gradients, so no
backward traffic and no pipeline bubble). One :class:`ActivationLink` joins two neighbouring ranks of a replica; every
byte goes through :mod:`lightning_hetero.comm` under the label :data:`~lightning_hetero.comm.PIPELINE`.

Wire format of one message (per training step and boundary):

- **synchronous** mode: the activations only, encoded by a
  :class:`~lightning_hetero.pipeline.boundary_codec.BoundaryCodec`
  (``fp32``: ``B*S*H*4`` bytes for a ``(B, S, H)`` hidden state; ``bf16``: ``*2``; ``int8``: ``B*S*(4*ceil(H/4)+4)``).
  Both ends read the same batch from their own data loader, so the receiver knows the batch; the per-sample shape
  is sent once per new input shape as a :data:`HEADER_LENGTH`-int64 header (64 bytes), then never again.
- **asynchronous** mode: a 64-byte header before every payload (the step that produced the batch, the batch size and
  the per-sample shape), because the receiver may be training on another step than the sender's.

A header is ``[step, batch, codec, ndim, *sample_shape]`` (int64, padded with -1). Nothing a peer sends is trusted
(docs/reliability.md): the receiver compares the header with what it knows locally (its own batch size, its codec,
the per-sample shape its :class:`~lightning_hetero.layerwise.stack.BlockStack` infers, the steps it can expect)
*before* it allocates the payload buffer. A header the receiver has no expectation for (an asynchronous message whose
batch it no longer keeps) is bounded by the layouts this stage has itself expected (:meth:`ActivationLink.allow_layout`:
the batch size, every sample dimension and the element count), never by what the peer announces. Activations must
decode to finite values within :data:`~lightning_hetero.comm.validation.MAX_PEER_MAGNITUDE` (and the stage's dtype),
int8 ones without a -128 byte or a scale that overflows (:meth:`~lightning_hetero.pipeline.boundary_codec.BoundaryCodec.
decode_received`). Both raise :class:`~lightning_hetero.comm.validation.PeerPayloadError` naming the peer and the
field (``header``, ``header.step``, ``header.batch``, ``header.codec``, ``header.ndim``, ``header.sample[i]``,
``payload``, ``values``, ``scale``). A bad header always raises
(the stream cannot be resynchronised); bad activations in asynchronous mode honour ``on_bad_payload="drop"``: the
message is left out (logged, counted in :attr:`ActivationLink.dropped_payloads`) and the stage replays older ones.

Labels and attention masks never travel: every stage reads them from its own copy of the batch (asynchronous mode
keeps its recent batches in a :class:`~lightning_hetero.layerwise.replay.BatchRing`). Nothing here imports Lightning.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_hetero import comm
from lightning_hetero.comm.validation import (
    PeerPayloadError,
    check_announced_size,
    report_dropped,
    validate_on_bad_payload,
)
from lightning_hetero.pipeline.boundary_codec import BoundaryCodec

__all__ = [
    "HEADER_LENGTH",
    "MAX_MESSAGE_ELEMENTS",
    "ActivationLink",
    "Expectation",
    "bad_payload_policy",
    "batch_signature",
    "header_bytes",
]

HEADER_LENGTH = 8
"""int64 entries of a header: ``[step, batch, codec, ndim, *sample_shape]`` padded with -1 (at most 4 sample dims)."""
_FIXED_FIELDS = 4
_MAX_SAMPLE_DIMS = HEADER_LENGTH - _FIXED_FIELDS
_CODEC_CODES = {"fp32": 0, "bf16": 1, "int8": 2}
MAX_MESSAGE_ELEMENTS = 1 << 30
"""Bound on ``batch * prod(sample_shape)`` of a header the receiver cannot compare with any layout it knows (a link
used before this stage has expected anything; the runtimes always hand it their own layout first)."""

Expectation = tuple[int, tuple[int, ...]] | None
"""What the receiver knows of a message: ``(batch_size, sample_shape)``, or None (only the bounds are checked)."""


def bad_payload_policy(owner: str, value: object, asynchronous: bool) -> str:
    """``on_bad_payload`` checked for an activation link: ``"drop"`` needs asynchronous mode (a replay buffer)."""
    policy = validate_on_bad_payload(owner, value)
    if policy == "drop" and not asynchronous:
        raise ValueError(
            f"{owner}(on_bad_payload='drop'): a synchronous stage needs the activations of its own step, so there is "
            "nothing to replace dropped ones with; use mode='async' (older activations are replayed) or "
            "on_bad_payload='raise'."
        )
    return policy


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
        on_bad_payload: ``"raise"`` (default) or ``"drop"``: what non-finite activations received in asynchronous
            mode do (a bad header, and anything on a synchronous link, always raises).
    """

    def __init__(
        self,
        peer: int,
        codec: str = "fp32",
        tag: int = 10,
        asynchronous: bool = False,
        max_in_flight: int = 2,
        label: str = comm.PIPELINE,
        on_bad_payload: str = "raise",
    ) -> None:
        BoundaryCodec(codec, 1)  # validates the name
        self.peer, self.codec_name, self.tag, self.asynchronous = peer, codec, tag, asynchronous
        self.max_in_flight = max(1, int(max_in_flight))
        self.label = label
        self.on_bad_payload = bad_payload_policy("ActivationLink", on_bad_payload, asynchronous)
        self.dropped_payloads = 0
        """Messages left out under ``on_bad_payload="drop"``."""
        self.last_error: PeerPayloadError | None = None
        """The last refused message (raised, or dropped)."""
        self._last_header: tuple[int, int] = (-1, 0)  # (message index, step): a peer's steps never decrease
        self._pending_sends: deque[list[tuple[Any, Tensor]]] = deque()
        self._sample_shapes: dict[tuple, tuple[int, ...]] = {}
        # ndim -> (largest batch, largest size per sample dimension, largest element count) this stage has expected
        self._layouts: dict[int, tuple[int, tuple[int, ...], int]] = {}
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
            header = self._header(step, values.shape[0], self.codec_name, sample, values.device)
            works.append(self._start(header, self.tag + 1))
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
    def _header(step: int, batch: int, codec: str, sample: tuple[int, ...], device: torch.device) -> Tensor:
        values = [step, batch, _CODEC_CODES[codec], len(sample), *sample] + [-1] * (_MAX_SAMPLE_DIMS - len(sample))
        return torch.tensor(values, dtype=torch.int64, device=device)

    # ------------------------------------------------------------------------------------------------ receiver
    def receive(
        self,
        batch_size: int,
        signature: tuple,
        device: torch.device,
        dtype: torch.dtype,
        expected_sample: tuple[int, ...] | None = None,
    ) -> Tensor:
        """Synchronous mode: block until the next activations arrive; returns them decoded to ``dtype``.

        ``expected_sample`` is the per-sample shape this stage infers for the batch (the header must announce it);
        without it only the bounds are checked. Raises :class:`PeerPayloadError` for a bad header or bad values.
        """
        if self.asynchronous:
            raise RuntimeError("ActivationLink.receive is the synchronous path; use poll/wait_next when asynchronous.")
        sample = self._sample_shapes.get(signature)
        if sample is None:
            header = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=device)
            comm.recv(header, self.peer, label=self.label, tag=self.tag + 1)
            _, _, sample = self.check_header(header, batch_size, expected_sample)
            self._sample_shapes[signature] = sample
        wire = self._wire_buffer(batch_size, sample, device)
        comm.recv(wire, self.peer, label=self.label, tag=self.tag)
        self.messages_received += 1
        return self.check_and_decode(wire, batch_size, sample, dtype)

    def _refuse(self, problem: str, field: str | None = None) -> PeerPayloadError:
        self.last_error = PeerPayloadError(
            f"ActivationLink: activations from rank {self.peer} {problem}", self.peer, field
        )
        return self.last_error

    @contextlib.contextmanager
    def _decoding(self, what: str) -> Iterator[None]:
        """Any error while checking or decoding a peer's message becomes a PeerPayloadError kept in ``last_error``."""
        try:
            try:
                yield
            except PeerPayloadError:
                raise
            except Exception as error:  # noqa: BLE001 - nothing but PeerPayloadError leaves a decoder
                raise PeerPayloadError(
                    f"ActivationLink: {what} from rank {self.peer} could not be checked ({type(error).__name__}: "
                    f"{error}); refusing it.",
                    self.peer,
                    what,
                ) from error
        except PeerPayloadError as error:
            self.last_error = error
            raise

    def allow_layout(self, batch_size: int, sample: tuple[int, ...]) -> None:
        """Record a layout this stage itself expects (its own batch size and block input shape).

        A header with no local expectation (see :meth:`check_header`) may announce at most the largest batch, the
        largest size per sample dimension and the largest element count recorded for its number of dimensions.
        """
        sample = tuple(int(d) for d in sample)
        batch, dims, elements = self._layouts.get(len(sample), (0, (0,) * len(sample), 0))
        self._layouts[len(sample)] = (
            max(batch, int(batch_size)),
            tuple(max(a, b) for a, b in zip(dims, sample, strict=True)),
            max(elements, int(batch_size) * _product(sample)),
        )

    def _check_against_layouts(self, batch: int, sample: tuple[int, ...], batch_known: bool) -> None:
        """Bound an announced size by the layouts this stage has expected (:meth:`allow_layout`)."""
        if not self._layouts:  # nothing local to compare with yet: only the global bound
            if batch * _product(sample) > MAX_MESSAGE_ELEMENTS:
                raise self._refuse(
                    f"announce {batch} x {sample} values, above the {MAX_MESSAGE_ELEMENTS} a message may hold; "
                    "refusing to allocate them.",
                    "header.sample",
                )
            return
        layout = self._layouts.get(len(sample))
        if layout is None:
            raise self._refuse(
                f"announce a {len(sample)}-dimensional sample shape {sample}, but this stage's own layout has "
                f"{sorted(self._layouts)}-dimensional samples; refusing them before allocating anything.",
                "header.ndim",
            )
        max_batch, max_dims, max_elements = layout
        own = f"this stage's own layout allows at most batch {max_batch}, sample {max_dims}"
        sizes = ([] if batch_known else [("header.batch", batch, max_batch)]) + [
            (f"header.sample[{i}]", d, limit) for i, (d, limit) in enumerate(zip(sample, max_dims, strict=True))
        ]
        for field, announced, limit in sizes:
            try:
                check_announced_size(announced, limit, peer=self.peer, what=field, minimum=1)
            except PeerPayloadError:
                raise self._refuse(
                    f"announce {batch} x {sample}: {field} = {announced} is outside [1, {limit}] ({own}); refusing "
                    "them before allocating anything.",
                    field,
                ) from None
        if batch * _product(sample) > max_elements:
            raise self._refuse(
                f"announce {batch} x {sample} values; {own} and {max_elements} values in all.", "header.sample"
            )

    def check_header(
        self, header: Tensor, batch_size: int | None = None, expected_sample: tuple[int, ...] | None = None
    ) -> tuple[int, int, tuple[int, ...]]:
        """``(step, batch, sample_shape)`` of a received header, checked before anything is allocated from it.

        Args:
            header: The :data:`HEADER_LENGTH` int64 values received.
            batch_size: The batch size this stage read for that step (None: unknown, only bounded).
            expected_sample: The per-sample shape this stage infers for that batch; the header must announce exactly
                that. None: the sizes must be positive, with at most :data:`MAX_MESSAGE_ELEMENTS` elements in all.

        Raises:
            PeerPayloadError: wrong length or dtype, another codec, a malformed or oversized shape, a shape or batch
                other than the expected one, or (asynchronous) a step that goes back or lies ahead of the messages.
        """
        with self._decoding("header"):
            return self._check_header(header, batch_size, expected_sample)

    def _check_header(
        self, header: Tensor, batch_size: int | None, expected_sample: tuple[int, ...] | None
    ) -> tuple[int, int, tuple[int, ...]]:
        if batch_size is not None and expected_sample is not None:
            self.allow_layout(batch_size, expected_sample)  # local knowledge: it also bounds later, stale headers
        if header.dtype != torch.int64 or header.numel() != HEADER_LENGTH:
            raise self._refuse(
                f"came with a header of {header.numel()} {header.dtype} values, not {HEADER_LENGTH} int64.", "header"
            )
        values = [int(v) for v in header.reshape(-1).tolist()]
        step, batch, codec, ndim = values[:_FIXED_FIELDS]
        if codec != _CODEC_CODES[self.codec_name]:
            names = {code: name for name, code in _CODEC_CODES.items()}
            raise self._refuse(
                f"are encoded as {names.get(codec, f'unknown codec {codec}')!r}, but this stage decodes "
                f"{self.codec_name!r}; give every stage the same activation_dtype.",
                "header.codec",
            )
        if not 1 <= ndim <= _MAX_SAMPLE_DIMS or any(v != -1 for v in values[_FIXED_FIELDS + ndim :]):
            raise self._refuse(
                f"came with a malformed header {values} (ndim {ndim}, or padding other than -1).", "header.ndim"
            )
        sample = tuple(values[_FIXED_FIELDS : _FIXED_FIELDS + ndim])
        if batch < 1 or any(d < 1 for d in sample):
            raise self._refuse(
                f"announce a non-positive size: batch {batch}, sample shape {sample}.",
                "header.batch" if batch < 1 else "header.sample",
            )
        if batch_size is not None and batch != batch_size:
            raise self._refuse(
                f"announce a batch of {batch} samples, this stage read {batch_size}; refusing them. Every stage of a "
                "replica must read the same batches (same data loader and seed).",
                "header.batch",
            )
        if expected_sample is not None and sample != tuple(expected_sample):
            raise self._refuse(
                f"announce a sample shape {sample}, but this stage's block expects {tuple(expected_sample)}; refusing"
                " them (a peer built from another model or split).",
                "header.sample",
            )
        if expected_sample is None:
            self._check_against_layouts(batch, sample, batch_known=batch_size is not None)
        if self.asynchronous:
            index = self.messages_received
            # The previous message's step bounds this one from below (unless the count was reset by a resume).
            floor = self._last_header[1] if self._last_header[0] == index - 1 else 0
            if not floor <= step <= index:
                raise self._refuse(
                    f"announce step {step}, but message {index} can only carry steps {floor}..{index} (the step "
                    "that produced a batch never goes back, nor past the message's own index).",
                    "header.step",
                )
            self._last_header = (index, step)
        return step, batch, sample

    def check_and_decode(self, wire: Tensor, batch: int, sample: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """Decode a received wire tensor after checking its length, dtype and values (see :meth:`check_header`).

        Raises:
            PeerPayloadError: a wire tensor of another length or dtype than ``(batch, *sample)`` encoded by this
                link's codec, non-finite values, or a bad int8 scale.
        """
        with self._decoding("activations"):
            codec = BoundaryCodec(self.codec_name, sample[-1])
            expected = batch * _product(sample[:-1]) * codec.wire_width
            if wire.numel() != expected or wire.dtype != codec.wire_dtype:
                raise self._refuse(
                    f"came as {wire.numel()} {wire.dtype} values; a batch of {batch} x {sample} in the "
                    f"{self.codec_name} codec is {expected} {codec.wire_dtype} values.",
                    "payload",
                )
            wire = wire.reshape(batch, *sample[:-1], codec.wire_width)
            return codec.decode_received(wire, dtype, peer=self.peer, what="activations")

    def nothing_to_replay(self, step: int) -> PeerPayloadError:
        """The error when this step's activations were dropped and the replay buffer holds none fresh enough."""
        return self._refuse(
            f"for step {step} were dropped (on_bad_payload='drop') and the replay buffer holds none fresh enough to "
            f"train on instead; the dropped message: {self.last_error}"
        )

    def _wire_buffer(self, batch: int, sample: tuple[int, ...], device: torch.device) -> Tensor:
        codec = BoundaryCodec(self.codec_name, sample[-1])
        return torch.empty((batch, *sample[:-1], codec.wire_width), dtype=codec.wire_dtype, device=device)

    def poll(
        self,
        limit: int,
        device: torch.device,
        dtype: torch.dtype,
        block: bool = False,
        expect: Callable[[int], Expectation] | None = None,
    ) -> list[tuple[int, Tensor]]:
        """Asynchronous mode: the ``(step, activations)`` messages completed so far, in order.

        Keeps one receive posted (header, then payload) while fewer than ``limit`` messages have arrived in all (so
        nothing is left posted once the sender is done). ``block=True`` waits until at least one message completes.
        ``expect(step)`` gives ``(batch_size, sample_shape)`` of this stage's batch of ``step`` when it still has it
        (see :meth:`check_header`); ``expect(limit - 1)``, the batch this stage is on, is recorded with
        :meth:`allow_layout` on every call, so a message whose batch is no longer kept is bounded by layouts this stage
        has read. Messages with bad values raise, or are left out under ``on_bad_payload="drop"`` (they still count
        as received).
        """
        done: list[tuple[int, Tensor]] = []
        current = expect(limit - 1) if expect is not None and limit > 0 else None
        if current is not None:  # the batch this stage is on: every step's layout bounds later, stale messages
            self.allow_layout(*current)
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
            if "wire" not in state:  # the header arrived: check it, then post the payload
                known = None
                if expect is not None:
                    announced = int(state["header"][0])
                    # Only a step a message can carry is looked up (check_header refuses the others).
                    known = expect(announced) if 0 <= announced <= self.messages_received else None
                step, batch, sample = self.check_header(state["header"], *(known or (None, None)))
                wire = self._wire_buffer(batch, sample, device)
                state.update(step=step, batch=batch, sample=sample, wire=wire)
                state["work"] = comm.irecv(wire, self.peer, label=self.label, tag=self.tag)
                continue
            self._in_flight = None
            self.messages_received += 1
            try:
                decoded = self.check_and_decode(state["wire"], state["batch"], state["sample"], dtype)
            except PeerPayloadError as error:
                if self.on_bad_payload != "drop":
                    raise
                report_dropped(error, f"left out the activations of step {state['step']}; the stage replays", self)
                continue
            done.append((state["step"], decoded))

    def drain_until(
        self,
        count: int,
        device: torch.device,
        dtype: torch.dtype,
        expect: Callable[[int], Expectation] | None = None,
    ) -> list[tuple[int, Tensor]]:
        """Asynchronous mode: receive until ``count`` messages in all have arrived (blocking); returns the new ones."""
        done: list[tuple[int, Tensor]] = []
        while self.messages_received < count:
            done += self.poll(count, device, dtype, block=True, expect=expect)
        return done


def _product(values: tuple[int, ...]) -> int:
    result = 1
    for value in values:
        result *= value
    return result
