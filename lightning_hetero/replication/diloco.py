"""DiLoCo: ``H`` purely local optimizer steps, then an outer Nesterov-momentum step on the averaged parameter delta.

Per parameter, with ``theta_0`` the anchor (the parameters right after the last synchronisation, identical on every
replica) and ``theta_r`` replica ``r``'s parameters after its ``H`` local (inner) steps:

.. math::

    \\Delta = \\frac{1}{n} \\sum_r (\\theta_0 - \\theta_r), \\qquad
    m \\leftarrow \\mu m + \\Delta, \\qquad
    \\theta \\leftarrow \\theta_0 - \\eta_{out} (\\Delta + \\mu m), \\qquad \\theta_0 \\leftarrow \\theta

(``torch.optim.SGD(nesterov=True)`` on the pseudo-gradient ``Delta``). ``outer_lr=1, outer_momentum=0`` is plain
parameter averaging every ``H`` steps. The inner steps exchange nothing (the optimizer's local state, e.g. Adam moments
or DeMo momentum, stays local), so bytes flow only on steps ``H, 2H, ...``: one ``all_reduce`` of every parameter's
delta (fp32/bf16), or an all_gather of sign/ternary-packed deltas (one scale per tensor, no error feedback).
``sync_every`` defaults to ``round(1 / kept_fraction)`` so that the average bytes per step are ``kept_fraction`` times
those of a dense fp32 exchange.

DeMo + DiLoCo (``outer_kept_fraction``): the synchronising step sends, instead of the whole delta, the top-k of the
chunked DCT of ``e + (theta_0 - theta_r)`` (DeMo's encoder, error feedback ``e`` kept per parameter: what was not
sent this period is sent in a later one), and ``Delta`` is the replica mean of the decoded coefficients. Bytes then
shrink twice: by ``H`` (steps without exchange) and by ``outer_kept_fraction`` (the delta's payload).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_hetero.comm.timing import wall_clock
from lightning_hetero.replication.base import Bucket, Piece, validate_kept_fraction
from lightning_hetero.replication.dense import FullReplicator
from lightning_hetero.replication.sparse import DeMoReplicator

__all__ = ["DiLoCoReplicator"]


class DiLoCoReplicator(FullReplicator):
    """Local steps plus a periodic outer Nesterov step on the replica-mean parameter delta (optionally DCT top-k sent).

    Args:
        kept_fraction: Sets the default ``sync_every = max(1, round(1 / kept_fraction))``.
        sync_every: ``H``, local steps between synchronisations.
        outer_lr: Outer learning rate ``eta_out`` (DiLoCo paper: 0.7).
        outer_momentum: Outer Nesterov momentum ``mu`` (DiLoCo paper: 0.9).
        values: Encoding of the delta on the wire (with ``outer_kept_fraction``: of its kept DCT coefficients).
        outer_kept_fraction: DeMo + DiLoCo: send only this fraction of the delta's chunked-DCT coefficients (top-k
            per chunk, with error feedback) at each synchronisation. None (default): the whole delta.
        outer_chunk: DCT block side of the compressed delta (only with ``outer_kept_fraction``).
        seed: Unused.
    """

    name = "diloco"
    compresses = True  # communication is reduced (by skipping steps), so one replica gets the usual warning

    def __init__(
        self,
        kept_fraction: float = 1 / 32,
        *,
        sync_every: int | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        values: str = "fp32",
        outer_kept_fraction: float | None = None,
        outer_chunk: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__(kept_fraction, values=values, seed=seed)
        self.outer_codec: DeMoReplicator | None = None
        """DeMo's encoder for the delta (DeMo + DiLoCo), or None for the dense delta."""
        if outer_kept_fraction is not None:
            try:
                validate_kept_fraction(outer_kept_fraction)
            except ValueError as error:
                raise ValueError(f"outer_{error}") from None
            self.outer_codec = DeMoReplicator(outer_kept_fraction, chunk=outer_chunk, values=values)
        elif outer_chunk != 64:
            raise ValueError("outer_chunk only applies with outer_kept_fraction (DeMo + DiLoCo); set both or neither.")
        self.outer_residuals: dict[int, torch.Tensor] = {}
        if sync_every is None:
            sync_every = max(1, round(1 / self.kept_fraction))
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive integer (local steps per sync), got {sync_every!r}.")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr!r}.")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}.")
        self.sync_every = sync_every
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.anchors: dict[int, torch.Tensor] = {}
        self.outer_buffers: dict[int, torch.Tensor] = {}
        self.syncs = 0

    def describe(self) -> dict[str, Any]:
        """The configuration, for logs."""
        base = {k: v for k, v in super().describe().items() if k != "seed"}
        outer = {"sync_every": self.sync_every, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}
        if self.outer_codec is not None:
            outer.update(outer_kept_fraction=self.outer_codec.kept_fraction, outer_chunk=self.outer_codec.chunk)
        return {**base, **outer}

    def setup(self, group: Any | None) -> None:
        """Use ``group`` for the delta exchange (the DeMo encoder of DeMo + DiLoCo too)."""
        super().setup(group)
        if self.outer_codec is not None:
            self.outer_codec.setup(group)

    def set_bad_payload_policy(self, policy: str) -> None:
        """``"raise"`` or ``"drop"`` for corrupt replica payloads, also in the compressed delta exchange."""
        super().set_bad_payload_policy(policy)
        if self.outer_codec is not None:
            self.outer_codec.set_bad_payload_policy(policy)

    def payload_bytes(self, local_shapes: Sequence[torch.Size | tuple[int, ...]]) -> int:
        """Bytes of one synchronising step: the dense delta, or its packed DCT top-k (DeMo + DiLoCo)."""
        if self.outer_codec is not None:
            return self.outer_codec.payload_bytes(local_shapes)
        return super().payload_bytes(local_shapes)

    def syncs_at(self, step: int) -> bool:
        """Whether the optimizer step with 0-based index ``step`` ends with a synchronisation."""
        return (step + 1) % self.sync_every == 0

    # -------------------------------------------------------------------------------------- per-step exchange
    def launch(self, pieces: list[Piece], *, early: bool = False) -> Bucket:
        """Inner steps are local: nothing is sent, the "combined" gradient is the local one."""
        self.stats["buckets"] += 1
        empty = torch.empty(0)
        return Bucket(pieces, "local", empty, empty, None, wall_clock(), early, [0] * len(pieces))

    def finish(self, bucket: Bucket) -> list[torch.Tensor]:
        """The local tensors themselves."""
        return [piece.meta["local"] for piece in bucket.pieces]

    def encode(self, key: int, source: torch.Tensor) -> Piece:
        """Keep the local gradient (inner steps do not communicate)."""
        return Piece(key, tuple(source.shape), torch.empty(0, device=source.device), {"local": source})

    # ------------------------------------------------------------------------------------------ outer step
    def start_step(self, params: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Record the anchors (the parameters before the first inner step) the first time."""
        super().start_step(params)
        for key, param in params:
            if key not in self.anchors:
                self.anchors[key] = param.detach().float().clone()
            else:
                self.anchors[key] = self.anchors[key].to(param.device)

    def end_step(self, params: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Every ``sync_every`` steps: average the deltas, take the outer Nesterov step, reset the anchors."""
        if self.syncs_at(self.step):
            self._synchronise(params)
        super().end_step(params)

    def _synchronise(self, params: Sequence[tuple[int, torch.Tensor]]) -> None:
        deltas = [(key, self.anchors[key] - param.detach().float()) for key, param in params]
        mean_deltas = self._exchange_deltas(deltas) if self.outer_codec is not None else self._mean(deltas)
        for (key, param), delta in zip(params, mean_deltas, strict=True):
            buffer = self.outer_buffers.get(key)
            buffer = delta.clone() if buffer is None else buffer.to(delta.device).mul_(self.outer_momentum).add_(delta)
            self.outer_buffers[key] = buffer
            update = delta.add(buffer, alpha=self.outer_momentum)
            param.copy_(self.anchors[key].sub(update, alpha=self.outer_lr))
            self.anchors[key] = param.detach().float().clone()  # the rounded value every replica now holds
        self.syncs += 1

    def _mean(self, deltas: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """The replica mean of the whole deltas (one all_reduce, or a gather of sign/ternary-packed ones)."""
        bucket = FullReplicator.launch(self, [FullReplicator.encode(self, key, delta) for key, delta in deltas])
        return FullReplicator.finish(self, bucket)

    def _exchange_deltas(self, deltas: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """DeMo + DiLoCo: DCT top-k of (residual + delta), error feedback into the residual, replica-mean decode."""
        codec = self.outer_codec
        assert codec is not None  # only called with outer_kept_fraction
        codec._reset_stats()
        pieces = []
        for key, delta in deltas:
            residual = self.outer_residuals.get(key)
            residual = delta if residual is None else residual.to(delta.device).add_(delta)
            pieces.append(codec.encode(key, residual))  # subtracts what was sent from the residual in place
            self.outer_residuals[key] = residual
        mean_deltas = codec.finish(codec.launch(pieces))
        for name in ("wait_seconds", "comm_seconds", "encode_seconds", "decode_seconds", "payload_bytes"):
            self.stats[name] += codec.stats[name]
        self.dropped_payloads = codec.dropped_payloads
        return mean_deltas

    # ------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Step counter, number of syncs, anchors and outer momentum buffers (cloned)."""
        return {
            **super().state_dict(),
            "syncs": self.syncs,
            "anchors": {key: value.clone() for key, value in self.anchors.items()},
            "outer_buffers": {key: value.clone() for key, value in self.outer_buffers.items()},
            "outer_residuals": {key: value.clone() for key, value in self.outer_residuals.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (tensors move to the parameters' device at the next step)."""
        super().load_state_dict(state_dict)
        self.syncs = int(state_dict.get("syncs", 0))
        self.anchors = {int(k): v.clone() for k, v in state_dict.get("anchors", {}).items()}
        self.outer_buffers = {int(k): v.clone() for k, v in state_dict.get("outer_buffers", {}).items()}
        self.outer_residuals = {int(k): v.clone() for k, v in state_dict.get("outer_residuals", {}).items()}
