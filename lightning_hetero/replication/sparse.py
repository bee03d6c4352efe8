"""Sparse replicators: every replica picks its own top-k per chunk and all-gathers (indices, values).

- :class:`DeMoReplicator`: top-k of the chunked DCT-II coefficients (DeMo / FlexDeMo).
- :class:`TopKReplicator`: top-k by magnitude in the parameter domain, in 1-D chunks of ``chunk * chunk`` elements.

Both apply error feedback: the dequantized values this rank sent (exactly what receivers decode) are mapped back to
the tensor domain and subtracted from the local buffer, so everything not sent (and every quantization error) stays
in the buffer and is sent later. The decode sums every rank's sparse coefficients in rank order (each rank's indices
are unique within a chunk, so a scatter without collisions per rank, then a plain add), divides by the number of
replicas (``combine="mean"``, default) or by the number of ranks that picked each coefficient
(``combine="pickers"``, the anchors' ``scatter_reduce(mean)`` semantics made deterministic), and inverts the
transform.

Wire per parameter: ``index_nbytes(B * k, index_bits) + value_nbytes(B * k, values, rows=B)`` bytes, ``B`` the
number of chunks and ``k = max(1, floor(kept_fraction * chunk_numel))``; indices address a position inside a chunk,
so 12-bit indices need chunks of at most 4096 coefficients (``chunk <= 64``) and 16-bit ones at most 65536
(``chunk <= 256``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from lightning_hetero.comm.payload_packing import (
    index_nbytes,
    pack_indices,
    pack_values,
    unpack_peer_indices,
    unpack_peer_values,
    unpack_values,
    validate_index_bits,
    value_nbytes,
)
from lightning_hetero.replication.base import Piece, Replicator, kept_count
from lightning_hetero.replication.transforms import ChunkedDCT, FlatChunks

__all__ = ["COMBINE_MODES", "DeMoReplicator", "TopKReplicator"]

COMBINE_MODES: tuple[str, ...] = ("mean", "pickers")
_MAX_CHUNK = 256  # 256 * 256 = 65536 coefficients per block: the most 16-bit indices can address


class _SparseReplicator(Replicator):
    """Shared machinery of DeMo and TopK: per-chunk top-k, packed gather, rank-ordered decode."""

    def __init__(
        self,
        kept_fraction: float = 1 / 32,
        *,
        chunk: int = 64,
        values: str = "fp32",
        index_bits: int | None = None,
        combine: str = "mean",
        seed: int = 0,
    ) -> None:
        super().__init__(kept_fraction, values=values, seed=seed)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= _MAX_CHUNK:
            raise ValueError(
                f"chunk must be an integer in [1, {_MAX_CHUNK}] (the block side; chunk * chunk coefficients per"
                f" block must be addressable by 16-bit indices), got {chunk!r}."
            )
        block = chunk * chunk
        if index_bits is None:
            index_bits = 12 if block <= 1 << 12 else 16
        index_bits = validate_index_bits(index_bits)
        if block > 1 << index_bits:
            raise ValueError(
                f"index_bits={index_bits} cannot address chunk={chunk} (chunk * chunk = {block} coefficients per"
                f" block, at most {1 << index_bits}): use index_bits=16 or chunk <= {int((1 << index_bits) ** 0.5)}."
            )
        if combine not in COMBINE_MODES:
            raise ValueError(f"combine must be one of {list(COMBINE_MODES)}, got {combine!r}.")
        self.chunk = chunk
        self.index_bits = index_bits
        self.combine = combine
        self.transform: FlatChunks = self._make_transform()

    def _make_transform(self) -> FlatChunks:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The configuration, for logs."""
        return {**super().describe(), "chunk": self.chunk, "index_bits": self.index_bits, "combine": self.combine}

    def _sizes(self, shape: Sequence[int]) -> tuple[int, int, int, int]:
        """``(n_blocks, block_numel, k, nbytes_of_indices)`` for a local shape."""
        layout = self.transform.layout(tuple(shape))
        k = kept_count(self.kept_fraction, layout.block_numel)
        count = layout.n_blocks * k
        return layout.n_blocks, layout.block_numel, k, index_nbytes(count, self.index_bits)

    def payload_bytes(self, local_shapes: Sequence[torch.Size | tuple[int, ...]]) -> int:
        """Sum over parameters of packed indices plus packed values (empty shards contribute nothing)."""
        total = 0
        for shape in local_shapes:
            n_blocks, _, k, idx_bytes = self._sizes(shape)
            total += idx_bytes + value_nbytes(n_blocks * k, self.values, n_blocks)
        return total

    def encode(self, key: int, source: torch.Tensor) -> Piece:
        """Top-k per chunk of ``transform(source)``, packed; subtracts what was sent from ``source`` in place."""
        started = time.perf_counter()
        shape = tuple(source.shape)
        n_blocks, _, k, idx_bytes = self._sizes(shape)
        if n_blocks == 0:
            return Piece(key, shape, torch.empty(0, dtype=torch.uint8, device=source.device))
        coefficients = self.transform.encode(source)
        indices = torch.topk(coefficients.abs(), k, dim=1, sorted=False).indices
        packed_values = pack_values(coefficients.gather(1, indices), self.values)
        wire = torch.cat((pack_indices(indices, self.index_bits), packed_values))
        # Error feedback with exactly what receivers will decode (dequantized values).
        sent_values = unpack_values(packed_values, n_blocks, k, self.values)
        sent = torch.zeros_like(coefficients).scatter_(1, indices, sent_values)
        source.sub_(self.transform.decode(sent, shape))
        self.stats["encode_seconds"] += time.perf_counter() - started
        return Piece(key, shape, wire, {"k": k, "index_bytes": idx_bytes})

    def _combine_gathered(self, piece: Piece, per_rank: list[torch.Tensor], ranks: list[int]) -> torch.Tensor:
        """Sum every rank's validated sparse coefficients in rank order, average, inverse transform.

        Each rank's indices must lie inside their block and be unique within it (a repeat would be applied twice by
        ``pickers`` and ambiguously by the scatter), and its values must be finite and bounded
        (:func:`~lightning_hetero.comm.payload_packing.unpack_peer_values`: also valid sign/ternary codes and scales).
        """
        layout = self.transform.layout(piece.shape)
        if layout.n_blocks == 0:
            return torch.zeros(piece.shape, dtype=torch.float32, device=piece.wire.device)
        k, idx_bytes = piece.meta["k"], piece.meta["index_bytes"]
        total = torch.zeros(layout.n_blocks, layout.block_numel, dtype=torch.float32, device=piece.wire.device)
        pickers = torch.zeros_like(total) if self.combine == "pickers" else None
        where = f" for parameter piece {piece.key}, whose blocks have {layout.block_numel} coefficients"
        for rank, data in zip(ranks, per_rank, strict=True):  # fixed rank order: the same additions on every replica
            flat = data.reshape(-1)
            indices = unpack_peer_indices(
                flat[:idx_bytes],
                layout.n_blocks * k,
                self.index_bits,
                limit=layout.block_numel,
                rows=layout.n_blocks,
                peer=rank,
                sender=f"replica {rank}",
                where=where,
            )
            rank_values = unpack_peer_values(
                flat[idx_bytes:], layout.n_blocks, k, self.values, peer=rank, sender=f"replica {rank}", where=where
            )
            indices = indices.view(layout.n_blocks, k).to(total.device)
            total += torch.zeros_like(total).scatter_(1, indices, rank_values.to(total.device))
            if pickers is not None:
                pickers.scatter_add_(1, indices, torch.ones_like(total[:, :k]))
        total = total / pickers.clamp(min=1.0) if pickers is not None else total / len(per_rank)
        return self.transform.decode(total, piece.shape)


class DeMoReplicator(_SparseReplicator):
    """DeMo: top-k of the chunked orthonormal DCT-II of the local momentum, with error feedback, all-gathered.

    Args:
        kept_fraction: Fraction of DCT coefficients kept per chunk (``k = max(1, floor(kept_fraction * chunk_numel))``).
        chunk: DCT block side: ``chunk x chunk`` blocks on matrices, ``chunk`` on vectors (smaller dims: their size).
        values: ``"fp32"``, ``"bf16"``, ``"sign"`` or ``"ternary"`` (sign/ternary: one fp32 scale per chunk).
        index_bits: 12 or 16; default 12 when ``chunk * chunk <= 4096`` else 16.
        combine: ``"mean"`` (sum over replicas / n, default) or ``"pickers"`` (sum / number of ranks that picked the
            coefficient, the anchors' semantics).
        seed: Unused (kept for a uniform signature).
    """

    name = "demo"

    def _make_transform(self) -> FlatChunks:
        return ChunkedDCT(self.chunk)


class TopKReplicator(_SparseReplicator):
    """Magnitude top-k in the parameter domain with error feedback, in 1-D chunks of ``chunk * chunk`` elements.

    Same arguments as :class:`DeMoReplicator`; ``chunk * chunk`` is the chunk length of the flattened tensor (so the
    in-chunk indices fit ``index_bits``) and sign/ternary scales are per chunk.
    """

    name = "topk"

    def _make_transform(self) -> FlatChunks:
        return FlatChunks(self.chunk * self.chunk)
