"""The model's training loss where the progress bar is: :class:`ModelLossReport`.

In a DGL pipeline only the last stage computes the model's loss; every other stage trains on an auxiliary loss of its
own. Lightning shows the progress bar (and writes the loggers) on global rank 0, which runs stage 0, so without help
the bar shows stage 0's auxiliary loss, a number unrelated to how well the model does. The last stage of replica 0
therefore sends its loss of every step to global rank 0 (8 + 8 bytes, ledger label ``metrics``).

Rank 0 does not wait for the step it is at: after its step ``t`` it takes the message of step ``t - lag``, where
``lag`` is how far stage 0 can run ahead of the last stage anyway (``(num_stages - 1) * (max_in_flight + 1)``), so in
the usual case that message is already there; the value it shows lags by ``lag`` steps. (Polling without waiting is
not an option: gloo's point-to-point works report completion only once waited on.) The sender keeps at most
``window`` sends in flight and waits for the oldest beyond that. At a :meth:`~ModelLossReport.flush` (before
evaluation, checkpoints, the export and the end of fit, when every stage has done the same steps) rank 0 takes every
message up to its own step count and the sender waits for its sends, so nothing is left in flight. Each message is
``[loss, step]`` (float64); rank 0 checks it by the peer-payload rule (finite, bounded, the step it expects) and
raises :class:`~lightning_hetero.comm.validation.PeerPayloadError` otherwise. Nothing here imports Lightning.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_hetero import comm
from lightning_hetero.comm.validation import PeerPayloadError, check_values, peer_decoding

__all__ = ["LOSS_LABEL", "LOSS_TAG", "ModelLossReport"]

LOSS_TAG = 30
"""Point-to-point tag of the loss messages (the activation links use 10/11 and 20/21)."""
LOSS_LABEL = "metrics"
"""Ledger label of the loss messages: a metric, like Lightning's metric reductions under the pipeline strategies; the
``pipeline`` label keeps counting the activations alone."""


class ModelLossReport:
    """Send the last stage's loss to global rank 0 each step, without blocking either side (see the module docstring).

    Args:
        role: ``"send"`` (last stage of replica 0), ``"receive"`` (global rank 0) or ``None`` (any other rank, or a
            one-stage pipeline, where the last stage is rank 0 itself).
        peer: Global rank of the other side.
        device: Device of the message tensors (the stage's: NCCL needs CUDA tensors).
        lag: The receiver takes the message of step ``t - lag`` after its step ``t``.
        window: Sends the sender keeps in flight before it waits for the oldest.
    """

    def __init__(self, role: str | None, peer: int | None, device: torch.device, lag: int = 0, window: int = 1) -> None:
        if role not in ("send", "receive", None):
            raise ValueError(f"ModelLossReport(role={role!r}): use 'send', 'receive' or None.")
        if lag < 0 or window < 1:
            raise ValueError(f"ModelLossReport(lag={lag}, window={window}): use lag >= 0 and window >= 1.")
        self.role, self.peer, self.device, self.lag, self.window = role, peer, device, lag, window
        self.value: float | None = None
        """The newest model loss known here (None before the first one arrives)."""
        self.step = -1
        """The step ``value`` belongs to."""
        self.received = 0
        """Messages the receiver has taken (the next one must be for this step)."""
        self._sends: list[tuple[Any, torch.Tensor]] = []

    def reset(self, steps: int) -> None:
        """Restart the count at ``steps`` (a resumed run: messages of earlier steps were taken before the save)."""
        self.received = steps
        self._sends = []

    def abandon(self) -> None:
        """Forget what is in flight and stop (a run that failed: the peer may be gone, so nothing is waited for)."""
        self.role = None
        self._sends = []

    def send(self, loss: torch.Tensor, step: int) -> None:
        """The sender's loss of ``step`` (0-based) goes to the receiver; returns at once."""
        self.value, self.step = float(loss), step
        if self.role != "send":
            return
        while len(self._sends) >= self.window:
            self._sends.pop(0)[0].wait()
        message = torch.tensor([float(loss), float(step)], dtype=torch.float64, device=self.device)
        self._sends.append((comm.isend(message, self.peer, label=LOSS_LABEL, tag=LOSS_TAG), message))

    def poll(self, steps_done: int, block: bool = False) -> None:
        """Receiver: take the messages of the first ``steps_done - lag`` steps (``block``: of all ``steps_done``).
        No-op elsewhere."""
        if self.role != "receive":
            return
        target = steps_done if block else steps_done - self.lag
        while self.received < target:
            message = torch.empty(2, dtype=torch.float64, device=self.device)
            comm.irecv(message, self.peer, label=LOSS_LABEL, tag=LOSS_TAG).wait()
            self.accept(message.cpu())

    def accept(self, message: torch.Tensor) -> None:
        """Take one received ``[loss, step]`` message (checked by the peer-payload rule)."""
        with peer_decoding(self.peer, "model_loss"):
            check_values(message, peer=self.peer, what="model_loss")
            raw = float(message[1])
        step = int(raw)
        if step != raw or step != self.received:
            raise PeerPayloadError(
                f"model_loss from rank {self.peer} is for step {raw:g}, but step {self.received} was expected (the "
                "last stage's loss messages arrive in order, one per step).",
                self.peer,
                "model_loss.step",
            )
        self.value, self.step = float(message[0]), step
        self.received += 1

    def flush(self, steps_done: int) -> None:
        """Leave nothing in flight: the receiver takes every message of its ``steps_done`` steps, the sender waits
        for its sends."""
        self.poll(steps_done, block=True)
        for work, _ in self._sends:
            work.wait()
        self._sends = []
