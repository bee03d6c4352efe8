"""Authenticated slots over torchft's managed process group: every participant's bytes, each with its HMAC tag.

The Manager's group is reconfigured at every quorum change and also offers all-gather (torchft's
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` wrap a plain process group). :class:`SlotExchange` all-gathers one
``payload || tag`` per participant (:mod:`lightning_hetero.ft.membership`, 32 bytes of tag per slot), in participant
order, and verifies every other participant's tag before anything is decoded. A slot that does not verify came from
a process without the cluster secret or was altered on the wire (a flipped bit, a replay of another step, quorum,
collective or slot): the step is discarded on this replica (``manager.report_error``, so ``should_commit`` is
False) with a warning naming the participant, and no honest replica is blamed or dropped for it.

Bytes: an all-gather of ``S + 32`` bytes per participant puts ``(n - 1)(S + 32)`` on the wire per replica (the
ledger's rule for ``all_gather``), the same as a plain all-gather of the payload plus the tags, and half the
``2 (n - 1) S`` of the zero-padded all-reduce the slots used before. Where the non-fault-tolerant exchange is an
all-reduce (``2 (n - 1) S / n``), per-replica tags need the contributions apart: ``(n - 1)(S + 32)``, equal for
``n = 2`` (plus 32 bytes) and ``n / 2`` times more beyond.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lightning_hetero import comm
from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.ft.membership import MAC_BYTES, ClusterSecret, SlotContext

__all__ = ["SlotExchange", "TamperedSlotError"]

log = logging.getLogger("lightning_hetero.ft")


class TamperedSlotError(PeerPayloadError):
    """A slot whose tag does not verify: from a non-member, or altered (or replayed) on the wire."""


class SlotExchange:
    """All-gather authenticated slots over a torchft Manager's process group.

    Args:
        manager: The replica group's ``torchft.Manager`` (its group, step, quorum id and error state are used).
        secret: The cluster secret.
        cluster: The cluster id bound into every tag.
    """

    def __init__(self, manager: Any, secret: ClusterSecret, cluster: str) -> None:
        self.manager = manager
        self.secret = secret
        self.cluster = cluster
        self._owner: object = None  # the quorum future the sequence numbers belong to (a new one per start_quorum)
        self._sequence = 0
        self.tampered_steps = 0
        """Steps discarded because a slot did not authenticate."""

    def context(self, count: int) -> SlotContext:
        """The next collective's context: sequence numbers restart with every quorum (every ``start_quorum``)."""
        owner = getattr(self.manager, "_quorum_future", None)
        if owner is not self._owner:
            self._owner, self._sequence = owner, 0
        quorum = getattr(self.manager, "_quorum_id", -1)
        context = SlotContext(self.cluster, int(self.manager.current_step()), int(quorum), count, self._sequence)
        self._sequence += 1
        return context

    def names(self, count: int) -> list[str]:
        """``participant i`` with the replica group number torchft derived from its id, when known."""
        ranks = getattr(getattr(self.manager, "_pg", None), "_global_ranks", None) or []
        width = max(int(getattr(self.manager, "_group_world_size", 1) or 1), 1)
        names = []
        for index in range(count):
            number = f" (replica group number {ranks[index] // width})" if index < len(ranks) else ""
            names.append(f"participant {index}{number}")
        return names

    def gather(self, payload: torch.Tensor) -> list[torch.Tensor] | None:
        """Every participant's ``payload`` (1-D uint8, same size everywhere), verified, in participant order.

        Returns:
            The payloads (this replica's own in its slot), or None when the step already failed, the collective
            failed (a peer left) or a slot did not authenticate: the step is then discarded (not committed).
        """
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(
                f"payload must be a 1-D uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}."
            )
        count = max(int(self.manager.num_participants()), 1)
        slot = self.manager.participating_rank()
        if self.manager.errored() is not None or slot is None or slot >= count:
            return None
        if count == 1:
            return [payload]
        context = self.context(count)
        own = payload.detach().cpu().contiguous()
        tag = torch.frombuffer(
            bytearray(self.secret.slot_tag(context, slot, memoryview(own.numpy()))), dtype=torch.uint8
        )
        sealed = torch.cat((own, tag)).to(payload.device)
        outputs = [torch.empty_like(sealed) for _ in range(count)]
        sent, received = comm.wire_bytes("all_gather", sealed.numel(), count)
        comm.get_ledger().record("all_gather", comm.INTER, sealed.numel(), sent, received, count)
        try:
            from torch.distributed.distributed_c10d import AllgatherOptions

            self.manager.wait_quorum()
            self.manager._pg.allgather([outputs], [sealed], AllgatherOptions()).wait()
        except Exception as error:  # noqa: BLE001 - a failed collective (a peer left) only discards the step
            log.warning("slot exchange failed (%s); the step is discarded", error)
            self.manager.report_error(error)
            return None
        host = [out.cpu() for out in outputs]
        bad = [
            index
            for index, out in enumerate(host)
            if index != slot
            and not self.secret.slot_ok(context, index, memoryview(out[:-MAC_BYTES].numpy()), out[-MAC_BYTES:].numpy())
        ]
        if bad:
            names = self.names(count)
            error = TamperedSlotError(
                f"step {context.step}, quorum {context.quorum}: the slot of {', '.join(names[i] for i in bad)} is not"
                " authenticated: tampered in transit or from a non-member (no or another cluster secret, or a replay);"
                " the step is discarded and no replica is blamed.",
                bad[0],
                "tag",
            )
            log.warning("%s", error)
            self.tampered_steps += 1
            self.manager.report_error(error)
            return None
        return [out[:-MAC_BYTES] if index != slot else payload for index, out in enumerate(outputs)]
