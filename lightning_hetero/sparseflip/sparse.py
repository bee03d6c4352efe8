"""The seed's sparse-gradient exchange for flip training: threshold, encode, aggregate, top-k flips, broadcast.

Every rank holds the same codes and a flat gradient ``g = dL/dcodes`` over a
:class:`~lightning_hetero.sparseflip.flip.CodeLayout` of ``numel`` codes. One step:

1. each rank keeps the entries with ``|g| > tau`` (``tau`` fixed) or its ``ceil(density * numel)`` largest ``|g|``
   (:func:`select_sparse`) and encodes them (:func:`encode_sparse`);
2. the lists are summed into a dense gradient in rank order, moves of codes already saturated in their direction are
   dropped and the ``k`` largest remaining ``|sum|`` become the flip set (:func:`aggregate_flips`), either
   - ``mode="server"``: workers ``send`` their list to the server rank, which aggregates and ``broadcast`` s the flip
     set (:func:`encode_flips`), or
   - ``mode="allgather"``: every rank ``all_gather`` s every list and aggregates the same way itself;
3. every rank applies the decoded flip set. Both modes decode the same bytes and sum in the same order, so they give
   the identical flip set, bit for bit, on every rank.

The byte layouts and their validating decoders live in :mod:`lightning_hetero.sparseflip.wire`.

Wire (counted by :mod:`lightning_hetero.comm`; :func:`exchange_bytes` is the exact formula the ledger records):
the server mode sends the 4-byte header then the body (skipped when empty) per worker, and broadcasts the flip
header then its body; the all-gather mode all-gathers the headers then the bodies zero-padded to the longest one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_hetero import comm
from lightning_hetero.comm import payload_packing
from lightning_hetero.comm.validation import (
    MAX_PEER_MAGNITUDE,
    PeerPayloadError,
    check_values,
    report_dropped,
    validate_on_bad_payload,
)
from lightning_hetero.sparseflip.flip import topk_moves
from lightning_hetero.sparseflip.wire import (
    HEADER_BYTES,
    decode_flips,
    decode_sparse,
    encode_flips,
    encode_sparse,
    flip_message_nbytes,
    index_bits,
    read_count,
    sparse_message_nbytes,
)

__all__ = [
    "EXCHANGE_MODES",
    "REFUSED",
    "all_gather_messages",
    "decode_lists",
    "SparseFlipExchange",
    "aggregate_flips",
    "exchange_bytes",
    "mean_of_lists",
    "select_sparse",
    "sum_lists",
]

EXCHANGE_MODES: tuple[str, ...] = ("server", "allgather")
REFUSED = 0xFFFFFFFF
"""Flip-set header count the server broadcasts when it refused a worker's list: every rank then raises."""


def select_sparse(
    grad: torch.Tensor, tau: float | None = None, density: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of a flat gradient worth sending: ``|g| > tau``, or the ``ceil(density * numel)`` largest ``|g|``.

    Exactly one of ``tau`` and ``density`` must be given. Zeros are never selected; ties go to the lower index.

    Returns:
        ``(indices int64 ascending, values float32)``.

    Raises:
        ValueError: Both or neither criterion, a bad value, or a NaN/Inf gradient.
    """
    if (tau is None) == (density is None):
        raise ValueError("give exactly one of tau and density.")
    flat = grad.detach().reshape(-1).float()
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("gradient contains NaN or Inf; refusing to send it.")
    magnitude = flat.abs()
    if tau is not None:
        if not tau >= 0:
            raise ValueError(f"tau must be >= 0, got {tau}.")
        indices = torch.nonzero(magnitude > tau).reshape(-1)
    else:
        if not 0.0 <= density <= 1.0:  # type: ignore[operator]
            raise ValueError(f"density must be in [0, 1], got {density}.")
        k = min(math.ceil(round(density * flat.numel(), 9)), flat.numel())  # type: ignore[operator]
        order = torch.argsort(magnitude, descending=True, stable=True)[:k]
        indices = order[magnitude[order] > 0].sort().values
    return indices, flat[indices]


def sum_lists(lists: Sequence[tuple[torch.Tensor, torch.Tensor]], numel: int) -> torch.Tensor:
    """The rank-order sum of decoded sparse lists as a dense float32 tensor of ``numel`` entries (on the CPU).

    Raises:
        PeerPayloadError: The sum is not finite or above ``len(lists) * MAX_PEER_MAGNITUDE`` (values finite alone
            can overflow together; decoded lists are bounded, so this only guards the combination itself).
    """
    dense = torch.zeros(numel, dtype=torch.float32)
    for indices, values in lists:
        dense.index_add_(0, indices.cpu(), values.cpu().float())
    check_values(dense, what="the sum of the sparse lists", bound=max(len(lists), 1) * MAX_PEER_MAGNITUDE)
    return dense


def mean_of_lists(lists: Sequence[tuple[torch.Tensor, torch.Tensor]], numel: int, contributors: int) -> torch.Tensor:
    """:func:`sum_lists` divided by ``contributors`` (at least 1), checked finite and within ``MAX_PEER_MAGNITUDE``.

    Raises:
        PeerPayloadError: The sum or the mean fails :func:`~lightning_hetero.comm.validation.check_values`.
    """
    mean = sum_lists(lists, numel) / max(int(contributors), 1)
    check_values(mean, what="the mean of the sparse lists")
    return mean


def aggregate_flips(
    lists: Sequence[tuple[torch.Tensor, torch.Tensor]], codes: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum sparse lists (in the given order) into a dense gradient and pick the top-``k`` allowed moves.

    Args:
        lists: ``(indices, values)`` per rank, rank order.
        codes: Flat int8 codes (identical on every rank).
        k: Maximum number of moves.

    Returns:
        ``(indices int64 ascending, directions int8)``; moves of saturated codes are never chosen.
    """
    return topk_moves(sum_lists(lists, codes.numel()), codes.reshape(-1).cpu(), k)


def exchange_bytes(
    message_nbytes: Sequence[int], flips_nbytes: int, mode: str, server: int = 0
) -> list[tuple[int, int]]:
    """Exact ``(sent, received)`` payload bytes of one exchange step per rank (what the ledger records).

    Args:
        message_nbytes: Encoded sparse-list size of every rank (rank order; see :func:`sparse_message_nbytes`).
        flips_nbytes: Encoded flip-set size (server mode only; see :func:`flip_message_nbytes`).
        mode: ``"server"`` or ``"allgather"``.
        server: Server rank (server mode).
    """
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"mode must be one of {list(EXCHANGE_MODES)}, got {mode!r}.")
    n = len(message_nbytes)
    if n <= 1:
        return [(0, 0)] * n
    if mode == "allgather":
        both = (n - 1) * max(message_nbytes)
        return [(both, both)] * n
    up = sum(size for rank, size in enumerate(message_nbytes) if rank != server)
    return [
        ((n - 1) * flips_nbytes, up) if r == server else (size, flips_nbytes) for r, size in enumerate(message_nbytes)
    ]


def all_gather_messages(
    message: torch.Tensor, n: int, numel: int, encoding: str, on_bad_payload: str = "raise", **kwargs: Any
) -> list[torch.Tensor]:
    """Every rank's sparse message (headers first, then the bodies zero-padded to the longest; counted).

    A header that announces more entries than ``numel`` is refused the same way on every rank (they all see the same
    headers): ``on_bad_payload="raise"`` raises; ``"drop"`` sizes that rank's body as empty and hands back its bare
    header bytes with the count, which :func:`decode_lists` then refuses (and drops).

    Raises:
        PeerPayloadError: a header announces more entries than ``numel`` (``on_bad_payload="raise"``).
    """
    headers = [torch.empty(HEADER_BYTES, dtype=torch.uint8) for _ in range(n)]
    comm.all_gather(headers, message[:HEADER_BYTES].clone(), **kwargs)
    sizes = []
    for rank, header in enumerate(headers):
        count = read_count(header)
        if count > numel:
            error = PeerPayloadError(
                f"sparse message header from rank {rank}: count {count} exceeds numel {numel}.", rank, "count"
            )
            if on_bad_payload != "drop":
                raise error
            sizes.append(HEADER_BYTES)  # sized as empty; decode_lists refuses the header itself
            continue
        sizes.append(sparse_message_nbytes(count, numel, encoding))
    longest = max(sizes) - HEADER_BYTES
    if longest == 0:
        return headers
    body = torch.zeros(longest, dtype=torch.uint8)
    mine = min(message.numel() - HEADER_BYTES, longest)  # a corrupt own header must not break the collective
    body[:mine] = message[HEADER_BYTES : HEADER_BYTES + mine]
    bodies = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
    comm.all_gather(bodies, body, **kwargs)
    return [torch.cat((h, b[: s - HEADER_BYTES])) for h, b, s in zip(headers, bodies, sizes, strict=True)]


def decode_lists(
    messages: Sequence[torch.Tensor],
    numel: int,
    encoding: str,
    on_bad_payload: str = "raise",
    owner: object = None,
    ranks: Sequence[int] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Decode every rank's sparse message; a refused one raises, or under ``"drop"`` becomes an empty list (logged).

    Args:
        messages: One message per rank, rank order.
        numel: Codes of the flat space.
        encoding: Value encoding of the lists.
        on_bad_payload: ``"raise"`` or ``"drop"``.
        owner: Object whose ``dropped_payloads`` counter a drop increments.
        ranks: The sender of each message (default: its position).
    """
    lists = []
    for position, raw in enumerate(messages):
        peer = position if ranks is None else ranks[position]
        try:
            lists.append(decode_sparse(raw, numel, encoding, peer=peer))
        except PeerPayloadError as error:
            if on_bad_payload != "drop":
                raise
            report_dropped(error, f"rank {peer}'s sparse list left out of this step", owner)
            lists.append((torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)))
    return lists


# ------------------------------------------------------------------------------------------------ the exchange
class SparseFlipExchange:
    """One distributed flip step over counted collectives (see the module docstring).

    Args:
        numel: Codes in the flat layout.
        k: Flips per step.
        tau: Fixed threshold on ``|g|`` (give this or ``density``).
        density: Fraction of entries each rank sends.
        encoding: Value encoding of the sparse lists.
        mode: ``"server"`` or ``"allgather"``.
        server: Group rank of the parameter server.
        label: Ledger label of the traffic.
        group: Process group (default WORLD).
        ledger: Ledger to record into (default: the process-global one).
        rule: ``rule(mean_gradient, codes) -> (indices, directions)`` deciding the flips (e.g.
            :class:`~lightning_hetero.sparseflip.rules.BopRule`); None: the top-``k`` of the summed lists.
        on_bad_payload: ``"raise"``: a corrupt list (index out of range, NaN/Inf, wrong length) raises
            :class:`~lightning_hetero.comm.validation.PeerPayloadError` on every rank; ``"drop"``: it is left out
            (logged, counted in ``dropped_payloads``). A header that cannot be sized in server mode always raises
            (the body that follows it cannot be skipped).
    """

    def __init__(
        self,
        numel: int,
        k: int,
        tau: float | None = None,
        density: float | None = None,
        encoding: str = "bf16",
        mode: str = "server",
        server: int = 0,
        label: str = comm.INTER,
        group: Any | None = None,
        ledger: comm.ByteLedger | None = None,
        rule: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
        on_bad_payload: str = "raise",
    ) -> None:
        self.on_bad_payload = validate_on_bad_payload(type(self).__name__, on_bad_payload)
        self.dropped_payloads = 0
        if mode not in EXCHANGE_MODES:
            raise ValueError(f"mode must be one of {list(EXCHANGE_MODES)}, got {mode!r}.")
        if (tau is None) == (density is None):
            raise ValueError("give exactly one of tau and density.")
        index_bits(numel)
        self.numel, self.k, self.tau, self.density = numel, k, tau, density
        self.encoding = payload_packing.validate_value_encoding(encoding)
        self.mode, self.server, self.label, self.group, self.ledger = mode, server, label, group, ledger
        self.rule = rule
        self.last_message_nbytes: list[int] = []
        self.last_flips_nbytes = 0
        self.last_bytes: tuple[int, int] = (0, 0)
        self.last_selected = 0
        self.last_message = torch.zeros(HEADER_BYTES, dtype=torch.uint8)

    def _rank_world(self) -> tuple[int, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    @property
    def last_sent(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, values)`` of this rank's last list as the others decode it (for error feedback)."""
        return decode_sparse(self.last_message, self.numel, self.encoding)

    def _decide(
        self, lists: Sequence[tuple[torch.Tensor, torch.Tensor]], codes: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The flip set from the decoded lists: top-k of the sum, or ``rule(sum / n, codes)``."""
        if self.rule is None:
            return aggregate_flips(lists, codes, self.k)
        return self.rule(mean_of_lists(lists, self.numel, n), codes.reshape(-1).cpu())

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def step(self, grad: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exchange this rank's sparse gradient and return the common flip set ``(indices, directions)``.

        Afterwards ``last_bytes`` is this rank's ``(sent, received)`` (the :func:`exchange_bytes` entry),
        ``last_selected`` the entries it sent, ``last_flips_nbytes`` the flip-set size, and ``last_message_nbytes``
        every rank's list size where this rank saw them (all-gather mode and the server; a worker sees its own).
        """
        if grad.numel() != self.numel or codes.numel() != self.numel:
            raise ValueError(f"grad and codes must have {self.numel} elements, got {grad.numel()}, {codes.numel()}.")
        indices, values = select_sparse(grad, self.tau, self.density)
        message = encode_sparse(indices, values, self.numel, self.encoding)
        self.last_selected = indices.numel()
        self.last_message = message
        rank, n = self._rank_world()
        kwargs = {"label": self.label, "group": self.group, "ledger": self.ledger}
        if n == 1 or self.mode == "allgather":
            messages = self._all_gather(message, n, kwargs) if n > 1 else [message]
            self.last_message_nbytes = [m.numel() for m in messages]
            lists = decode_lists(messages, self.numel, self.encoding, self.on_bad_payload, self)
            flips = encode_flips(*self._decide(lists, codes, n), self.numel)
            self.last_bytes = exchange_bytes(self.last_message_nbytes, flips.numel(), "allgather")[rank]
        else:
            self.last_message_nbytes = [message.numel()]
            flips = self._via_server(message, rank, n, codes, kwargs)
            if rank == self.server:
                self.last_bytes = exchange_bytes(self.last_message_nbytes, flips.numel(), "server", self.server)[rank]
            else:
                self.last_bytes = (message.numel(), flips.numel())
        self.last_flips_nbytes = flips.numel()
        return decode_flips(flips, self.numel, peer=self.server if self.mode == "server" and n > 1 else None)

    def _all_gather(self, message: torch.Tensor, n: int, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        return all_gather_messages(message, n, self.numel, self.encoding, self.on_bad_payload, **kwargs)

    def _size_from_header(self, header: torch.Tensor, src: int) -> int:
        count = read_count(header)
        if count > self.numel:
            raise PeerPayloadError(
                f"sparse message header from rank {src}: count {count} exceeds numel {self.numel}.", src, "count"
            )
        return sparse_message_nbytes(count, self.numel, self.encoding)

    def _refuse_to_workers(self, error: PeerPayloadError, server: int, kwargs: dict[str, Any]) -> None:
        """Server: tell every worker that this step is refused (so none waits for flips), then raise ``error``."""
        comm.broadcast(torch.tensor([0xFF] * HEADER_BYTES, dtype=torch.uint8), server, **kwargs)
        raise error

    def _via_server(
        self, message: torch.Tensor, rank: int, n: int, codes: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        server = self._global(self.server)
        if rank != self.server:
            comm.send(message[:HEADER_BYTES].clone(), server, **kwargs)
            if message.numel() > HEADER_BYTES:
                comm.send(message[HEADER_BYTES:].clone(), server, **kwargs)
        else:
            messages, unsized = [], None
            for src in range(n):
                if src == rank:
                    messages.append(message)
                    continue
                header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
                comm.recv(header, self._global(src), **kwargs)
                try:
                    size = self._size_from_header(header, src)
                except PeerPayloadError as error:  # its body cannot be sized, so it cannot be skipped: refuse the
                    unsized = unsized or error  # step, after hearing the other workers (so none of them blocks)
                    messages.append(header)
                    continue
                body = torch.empty(size - HEADER_BYTES, dtype=torch.uint8)
                if body.numel():
                    comm.recv(body, self._global(src), **kwargs)
                messages.append(torch.cat((header, body)))
            if unsized is not None:
                self._refuse_to_workers(unsized, server, kwargs)
            self.last_message_nbytes = [m.numel() for m in messages]
            try:
                lists = decode_lists(messages, self.numel, self.encoding, self.on_bad_payload, self)
                decided = self._decide(lists, codes, n)  # a refused combination must reach the workers too
            except PeerPayloadError as error:
                self._refuse_to_workers(error, server, kwargs)
            flips = encode_flips(*decided, self.numel)
        header = flips[:HEADER_BYTES].clone() if rank == self.server else torch.empty(HEADER_BYTES, dtype=torch.uint8)
        comm.broadcast(header, server, **kwargs)
        if read_count(header) == REFUSED:
            raise PeerPayloadError(
                f"the flip server (rank {server}) refused a corrupt sparse list this step (see its error); no flips.",
                server,
                "refused",
            )
        size = flip_message_nbytes(read_count(header), self.numel) if read_count(header) <= self.numel else -1
        if size < 0:
            raise PeerPayloadError(
                f"flip message header from the server (rank {server}): count exceeds numel.", server, "count"
            )
        body = (
            flips[HEADER_BYTES:].clone() if rank == self.server else torch.empty(size - HEADER_BYTES, dtype=torch.uint8)
        )
        if body.numel():
            comm.broadcast(body, server, **kwargs)
        return torch.cat((header, body))
