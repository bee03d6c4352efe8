"""``mode="demo"``: the per-region gradient exchange compressed with the FlexDeMo DeMo replicator.

Each bucket of :func:`~lightning_hetero.matformer.aggregate.aggregate_gradients` (all pieces shared by one rank set,
in one dtype) keeps an fp32 error-feedback buffer on every member. Per step and bucket with more than one member:

1. ``error += contribution`` (this rank's weighted gradient slabs, exactly what ``mean`` would all-reduce);
2. every slab of ``error`` is encoded by a :class:`~lightning_hetero.replication.DeMoReplicator` bound to
   the rank set's process group: top-k of its chunked DCT-II, and what was sent (dequantized) is subtracted from
   ``error`` in place, so everything not sent stays for later steps;
3. the bucket's packed bytes are all-gathered among the members only (one async collective per bucket, ledger label
   ``"inter"``), every member decodes all members' coefficients in rank order (bit-identical results everywhere);
4. the decoded mean times the member count is the (weighted) sum, which the caller divides by the contributor
   weights, as in ``mean``.

A bucket holds only slabs the rank trained (helpers, which send zeros for untrained neurons, are rejected), so no
untrained coordinate is ever encoded. Single-member buckets are exact and send nothing. The buffers are per rank;
:meth:`CompressedExchange.gather_state` collects them on rank 0 for the (single) checkpoint file. Rank 0 trains every
coordinate (tier 0), so every other rank's buckets are some of its own: it refuses an announced count above its own
total before allocating, and :func:`decode_error_feedback` refuses keys that are not its own buckets and NaN/Inf or
out-of-bound values, with a :class:`~lightning_hetero.comm.validation.PeerPayloadError` naming the rank and the field.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_hetero import comm
from lightning_hetero.comm.validation import (
    PeerPayloadError,
    check_announced_size,
    check_values,
    peer_decoding,
    validate_on_bad_payload,
)
from lightning_hetero.matformer.helper_ranks import HelperConfig
from lightning_hetero.matformer.layout import TierLayout
from lightning_hetero.matformer.region_groups import RegionGroups
from lightning_hetero.matformer.regions import layer_regions
from lightning_hetero.matformer.types import FFNParameter
from lightning_hetero.replication import Bucket, DeMoReplicator
from lightning_hetero.replication.settings import DEFAULT_KEPT_FRACTION, ReplicationSettings

__all__ = [
    "CHECKPOINT_KEY",
    "CHECKPOINT_LABEL",
    "CompressedExchange",
    "build_demo_replicator",
    "decode_error_feedback",
    "sets_without_rank0",
    "demo_bytes_per_step",
    "demo_payload_bytes",
]

CHECKPOINT_KEY = "matformer_error_feedback"
"""Checkpoint entry with every rank's error-feedback buffers."""
CHECKPOINT_LABEL = "checkpoint"
"""Ledger label of the one-off transfer of the buffers to rank 0 when a checkpoint is saved."""
_MAX_KEY_BYTES = 1 << 20  # bucket keys of one rank: a few dozen short strings; bounds a peer's announced size


def build_demo_replicator(replication: ReplicationSettings | None = None) -> DeMoReplicator:
    """A fresh DeMo replicator from ``replication`` (None: the defaults, 1/32 of the coefficients kept)."""
    replicator = (replication or ReplicationSettings()).build("demo")
    assert isinstance(replicator, DeMoReplicator)
    return replicator


@dataclass
class _Launched:
    """One bucket in flight."""

    replicator: DeMoReplicator
    bucket: Bucket
    members: int


class CompressedExchange:
    """Error-feedback state and one DeMo replicator per rank set, for ``aggregate_gradients(mode="demo")``.

    Build it once at setup, on every rank, after the :class:`RegionGroups` (it only reuses their process groups).

    Args:
        groups: The run's region groups; must have no helpers.
        kept_fraction: Fraction of DCT coefficients kept per chunk, in ``(0, 1]`` (default 1/32).
        chunk: DCT block side (default 64).
        values: Value encoding on the wire: ``"fp32"`` (default), ``"bf16"``, ``"sign"`` or ``"ternary"``.
        index_bits: 12 or 16 (default None: 12 when ``chunk * chunk <= 4096``).
        on_bad_payload: A member's payload with an out-of-block index or NaN/Inf: ``"raise"`` a
            :class:`~lightning_hetero.comm.validation.PeerPayloadError`, or ``"drop"`` it (the bucket is decoded
            from the other members, logged).

    Raises:
        ValueError: Helpers are active, or a bad exchange setting (named as a ``ReplicationSettings`` field).
    """

    def __init__(
        self,
        groups: RegionGroups,
        kept_fraction: float = DEFAULT_KEPT_FRACTION,
        *,
        chunk: int = 64,
        values: str = "fp32",
        index_bits: int | None = None,
        on_bad_payload: str = "raise",
    ) -> None:
        self.on_bad_payload = validate_on_bad_payload(type(self).__name__, on_bad_payload)
        if groups.helpers:
            raise ValueError(
                "mode='demo' cannot be combined with helpers (helper_fraction > 0): a helper sends zeros for the tail"
                " neurons it did not draw, and DeMo would encode those untrained coordinates into its error feedback."
                " Use helper_fraction=0 with mode='demo', or mode='mean'/'sign' with helpers."
            )
        self.groups = groups
        # Validated here, before any group is touched.
        self.replication = ReplicationSettings(
            kind="demo",
            kept_fraction=kept_fraction,
            chunk=chunk,
            values=values,  # type: ignore[arg-type]
            index_bits=index_bits,  # type: ignore[arg-type]
        )
        initialized = dist.is_available() and dist.is_initialized()
        world = tuple(range(groups.layout.world_size))
        self.replicators: dict[tuple[int, ...], DeMoReplicator] = {}
        """One replicator per rank set with more than one member, bound to that set's process group."""
        for members in groups.member_sets:
            if len(members) > 1 and groups.rank in members:
                replicator = build_demo_replicator(self.replication)
                replicator.set_bad_payload_policy(self.on_bad_payload)
                group = groups.group(members)
                replicator.setup(dist.group.WORLD if group is None and members == world and initialized else group)
                self.replicators[members] = replicator
        self.errors: dict[str, torch.Tensor] = {}
        """fp32 error-feedback buffer of every bucket this rank exchanged, keyed by :meth:`bucket_key`."""
        self._loaded: set[str] = set()

    @staticmethod
    def bucket_key(members: tuple[int, ...], dtype: torch.dtype, numel: int) -> str:
        """The key of a bucket's buffer: its rank set, gradient dtype and size (identical on every member)."""
        return f"{','.join(map(str, members))}|{str(dtype).removeprefix('torch.')}|{numel}"

    def payload_bytes(self, shapes: Sequence[torch.Size | tuple[int, ...]]) -> int:
        """Bytes one member contributes for a bucket of slabs of these shapes (the replicator's formula)."""
        return build_demo_replicator(self.replication).payload_bytes(shapes)

    # ------------------------------------------------------------------------------------------------ exchange
    def launch(self, members: tuple[int, ...], contribution: torch.Tensor, shapes: Sequence[torch.Size]) -> _Launched:
        """Add ``contribution`` (the flat bucket) to its error buffer, encode each slab, start the all-gather."""
        replicator = self.replicators.get(members)
        if replicator is None:
            raise KeyError(f"rank {self.groups.rank} exchanges nothing with ranks {members} (not a multi-rank set).")
        key = self.bucket_key(members, contribution.dtype, contribution.numel())
        error = self._buffer(key, contribution)
        error.add_(contribution)
        pieces, offset = [], 0
        for index, shape in enumerate(shapes):
            numel = math.prod(shape)
            pieces.append(replicator.encode(index, error[offset : offset + numel].view(shape)))
            offset += numel
        if offset != error.numel():
            raise ValueError(f"bucket {key}: slab shapes cover {offset} elements, the bucket has {error.numel()}.")
        return _Launched(replicator, replicator.launch(pieces), len(members))

    def finish(self, launched: _Launched, views: Sequence[torch.Tensor]) -> None:
        """Wait for the bucket and write the decoded (weighted) sum of every slab into ``views``."""
        decoded = launched.replicator.finish(launched.bucket)
        for view, mean in zip(views, decoded, strict=True):
            view.copy_(mean.mul_(launched.members))

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        error = self.errors.get(key)
        if error is None:
            error = self.errors[key] = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        elif error.device != like.device:
            error = self.errors[key] = error.to(like.device)
        self._loaded.discard(key)
        return error

    def check_loaded_state_used(self) -> None:
        """Warn once if buffers restored from a checkpoint matched no bucket of this run (a different config)."""
        if self._loaded:
            warnings.warn(
                f"rank {self.groups.rank}: error-feedback buffers {sorted(self._loaded)} from the checkpoint match no"
                " gradient bucket of this run (different tiers, model or dtype?); they are dropped.",
                stacklevel=2,
            )
            for key in self._loaded:
                self.errors.pop(key, None)
            self._loaded = set()

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback buffers (copies), by bucket key."""
        return {key: error.detach().clone() for key, error in sorted(self.errors.items())}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the buffers by ``state`` (moved to the bucket's device on first use)."""
        self.errors = {key: value.detach().to(torch.float32).clone().flatten() for key, value in state.items()}
        self._loaded = set(self.errors)

    def gather_state(self, device: torch.device) -> list[dict[str, torch.Tensor]] | None:
        """Every rank's :meth:`state_dict` on rank 0 (CPU tensors), None on the other ranks (collective).

        The sizes travel first (one small all-gather), then each rank sends its keys and its buffers concatenated to
        rank 0 (point to point, so only rank 0 holds more than its own state), labelled :data:`CHECKPOINT_LABEL`.
        Rank 0 bounds every announced size by its own buffers before allocating (it is a member of every rank set,
        so another rank's buffers are some of its own) and decodes with :func:`decode_error_feedback`.

        Raises:
            ValueError: Global rank 0 is not a member of every multi-rank set (it does not train every coordinate),
                so it could not bound what the others send; raised on every rank before anything is sent.
            PeerPayloadError: A rank announced more keys or values than rank 0's own buckets hold, or sent keys or
                values that do not describe rank 0's buckets; names the rank and the field.
        """
        state = self.state_dict()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [{key: value.cpu() for key, value in state.items()}]
        uncovered = sets_without_rank0(self.groups.member_sets)
        if uncovered:
            raise ValueError(
                f"CompressedExchange.gather_state: ranks {uncovered[0]} share a bucket without global rank 0, so rank 0"
                " cannot bound the error-feedback buffers it collects. Give rank 0 the full width of every layer "
                "(tier 0), as MatFormerStrategy requires."
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        keys = json.dumps(list(state)).encode()
        flat = torch.cat([v.to(device) for v in state.values()]) if state else torch.zeros(0, device=device)
        sizes = torch.tensor([len(keys), flat.numel()], dtype=torch.int64, device=device)
        every = torch.empty(2 * world, dtype=torch.int64, device=device)
        comm.all_gather_into_tensor(every, sizes, label=CHECKPOINT_LABEL)
        every_size = every.view(world, 2).tolist()
        if rank != 0:
            if keys:
                comm.send(torch.tensor(list(keys), dtype=torch.uint8, device=device), 0, label=CHECKPOINT_LABEL)
            if flat.numel():
                comm.send(flat, 0, label=CHECKPOINT_LABEL)
            return None
        limit = sum(value.numel() for value in state.values())
        out = [{key: value.cpu() for key, value in state.items()}]
        for source in range(1, world):
            key_bytes = check_announced_size(
                every_size[source][0], _MAX_KEY_BYTES, peer=source, what="error_feedback.key_bytes"
            )
            numel = check_announced_size(every_size[source][1], limit, peer=source, what="error_feedback.numel")
            raw = torch.empty(key_bytes, dtype=torch.uint8, device=device)
            values = torch.empty(numel, dtype=torch.float32, device=device)
            if key_bytes:
                comm.recv(raw, source, label=CHECKPOINT_LABEL)
            if numel:
                comm.recv(values, source, label=CHECKPOINT_LABEL)
            out.append(decode_error_feedback(raw, values, source=source, allowed=state))
        return out


def sets_without_rank0(member_sets: Collection[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The multi-rank sets that share a bucket without global rank 0 (none when rank 0 trains every coordinate).

    :meth:`CompressedExchange.gather_state` bounds what another rank sends by rank 0's own buckets, which holds only
    when this is empty.
    """
    return [members for members in member_sets if len(members) > 1 and 0 not in members]


def decode_error_feedback(
    raw: torch.Tensor, values: torch.Tensor, *, source: int, allowed: Collection[str]
) -> dict[str, torch.Tensor]:
    """Rank ``source``'s error-feedback buffers from its key bytes and values: bytes -> tensors, checked.

    Args:
        raw: The UTF-8 JSON list of bucket keys (``uint8``; empty when the rank holds no buffer).
        values: Every buffer concatenated (float32), in key order.
        source: The sending rank, named by every error.
        allowed: The bucket keys the receiver itself holds (rank 0 is a member of every rank set).

    Returns:
        One CPU float32 tensor per key, of the key's size.

    Raises:
        PeerPayloadError: Unreadable keys, keys that do not cover the values, a repeated key, a key that is not one of
            ``allowed`` or of a rank set without ``source`` (field ``"error_feedback.keys"``), or NaN, Inf or values
            above the magnitude bound (field ``"error_feedback.values"``).
    """
    with peer_decoding(source, "error_feedback.keys"):
        if raw.numel():
            names = _bucket_names(raw, source, values.numel())
        elif values.numel():
            raise PeerPayloadError(
                f"rank {source} sent {values.numel()} error-feedback values without bucket keys; refusing them.",
                source,
                "error_feedback.keys",
            )
        else:
            names = []
        bad = next((name for name in names if name not in allowed or source not in _members(name)), None)
        if bad is not None or len(set(names)) != len(names):
            problem = "a repeated key" if bad is None else f"key {bad[:80]!r}, not a bucket of rank 0 shared with it"
            raise PeerPayloadError(
                f"rank {source} sent error-feedback buffers with {problem}; refusing to checkpoint them.",
                source,
                "error_feedback.keys",
            )
    with peer_decoding(source, "error_feedback.values"):
        check_values(values, peer=source, what="error_feedback.values")
        numels = [int(name.rsplit("|", 1)[1]) for name in names]
        return dict(zip(names, (v.clone() for v in values.detach().cpu().split(numels)), strict=True))


def _members(name: str) -> tuple[int, ...]:
    """The rank set of a bucket key ``"0,1,2|dtype|numel"`` (empty when it is not a list of ranks)."""
    text = name.split("|", 1)[0]
    return (
        tuple(int(part) for part in text.split(","))
        if all(p.isascii() and p.isdigit() for p in text.split(","))
        else ()
    )


def _bucket_names(raw: torch.Tensor, source: int, numel: int) -> list[str]:
    """The bucket keys rank ``source`` sent, checked: a JSON list of ``"ranks|dtype|numel"`` covering ``numel``."""
    try:
        names = json.loads(bytes(raw.cpu().tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PeerPayloadError(
            f"rank {source} sent unreadable error-feedback bucket keys: {error}", source, "error_feedback.keys"
        ) from None
    ok = isinstance(names, list) and all(isinstance(n, str) and n.count("|") == 2 for n in names)
    sizes = [n.rsplit("|", 1)[1] for n in names] if ok else []
    if not ok or not all(size.isascii() and size.isdigit() for size in sizes) or sum(map(int, sizes)) != numel:
        raise PeerPayloadError(
            f"rank {source} sent error-feedback bucket keys {str(names)[:200]} that do not describe its {numel}"
            " values (a list of 'ranks|dtype|numel'); refusing to checkpoint them.",
            source,
            "error_feedback.keys",
        )
    return names


# ---------------------------------------------------------------------------------------------------- bytes
def _bucket_shapes(
    layout: TierLayout,
    ffn_params: Sequence[FFNParameter],
    param_shapes: Mapping[str, Sequence[int]],
    helpers: Mapping[int, HelperConfig] | None = None,
) -> dict[tuple[int, ...], list[tuple[int, ...]]]:
    """The slab shapes of every rank set's bucket (one dtype assumed), in no particular order."""
    ffn = {param.name: param for param in ffn_params}
    everyone = tuple(range(layout.world_size))
    buckets: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for name, shape in param_shapes.items():
        if name not in ffn:
            buckets.setdefault(everyone, []).append(tuple(shape))
            continue
        param = ffn[name]
        for region in layer_regions(layout, param.layer, helpers):
            slab = list(shape)
            slab[param.axis] = region.size
            buckets.setdefault(region.members, []).append(tuple(slab))
    return buckets


def _demo_payloads(
    layout: TierLayout,
    ffn_params: Sequence[FFNParameter],
    param_shapes: Mapping[str, Sequence[int]],
    replication: ReplicationSettings | None,
) -> dict[tuple[int, ...], int]:
    """The DeMo payload of each bucket that has more than one member (a lone member exchanges nothing)."""
    replicator = build_demo_replicator(replication)
    buckets = _bucket_shapes(layout, ffn_params, param_shapes)
    return {members: replicator.payload_bytes(shapes) for members, shapes in buckets.items() if len(members) > 1}


def _per_rank(world_size: int, per_bucket: Mapping[tuple[int, ...], int]) -> list[int]:
    """Each rank's total over the buckets it belongs to."""
    totals = [0] * world_size
    for members, amount in per_bucket.items():
        for rank in members:
            totals[rank] += amount
    return totals


def demo_payload_bytes(
    layout: TierLayout,
    ffn_params: Sequence[FFNParameter],
    param_shapes: Mapping[str, Sequence[int]],
    *,
    replication: ReplicationSettings | None = None,
) -> list[int]:
    """Bytes each rank contributes per step in ``mode="demo"`` (the ledger's ``payload_bytes`` of its gathers).

    Per rank: the sum, over the buckets of the rank sets it belongs to that have more than one member, of the DeMo
    payload of each slab: ``index_nbytes(B * k, index_bits) + value_nbytes(B * k, values, B)`` with ``B`` the slab's
    DCT blocks and ``k = max(1, floor(kept_fraction * block_numel))`` (``replication``: the exchange's settings,
    None: the defaults). Other arguments as for :func:`~lightning_hetero.matformer.tiers.bucket_numels` (full shapes
    of every parameter with a gradient).
    """
    return _per_rank(layout.world_size, _demo_payloads(layout, ffn_params, param_shapes, replication))


def demo_bytes_per_step(
    layout: TierLayout,
    ffn_params: Sequence[FFNParameter],
    param_shapes: Mapping[str, Sequence[int]],
    *,
    replication: ReplicationSettings | None = None,
) -> list[int]:
    """Bytes each rank sends (and receives) per step in ``mode="demo"``: ``(n - 1) * payload`` per bucket of ``n``.

    The all-gather rule of :func:`~lightning_hetero.comm.ledger.wire_bytes`; compare with
    :func:`~lightning_hetero.matformer.tiers.bytes_per_step` for ``mean``.
    """
    payloads = _demo_payloads(layout, ffn_params, param_shapes, replication)
    return _per_rank(layout.world_size, {members: (len(members) - 1) * n for members, n in payloads.items()})
