"""Log what each optimizer step put on the wire, and how long that would take on a slow link.

:class:`CommunicationMonitor` is a thin Lightning view over the process-global
:class:`~lightning_hetero.comm.ByteLedger`: it stamps the ledger with ``trainer.global_step`` at the start of every
training batch, so all micro-batches of one optimizer step (gradient accumulation) land in the same step bucket, and
logs the bucket when the optimizer step completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_hetero.comm.ledger import ByteLedger, LedgerTotals, get_ledger, validate_label
from lightning_hetero.comm.units import parse_bandwidth

__all__ = ["CommunicationMonitor"]


class CommunicationMonitor(Callback):
    """Log bytes sent and received per link label, per optimizer step, plus projected transfer time.

    For every label, after every ``log_every_n_steps``-th optimizer step, it logs:

    - ``comm/{label}/bytes_sent_step`` and ``comm/{label}/bytes_received_step``: bytes of the step that just
      finished (all its micro-batches, including the optimizer step itself);
    - ``comm/{label}/bytes_sent_total``: bytes sent since the fit began, plus the totals restored from a checkpoint.
      This includes traffic outside training steps (e.g. validation, sanity check);
    - ``comm/{label}/seconds_at_{bw}`` for each bandwidth: ``max(sent, received) * 8 / bits_per_second`` of that step,
      the time a full-duplex link of that rate would need. ``{bw}`` is the bandwidth string as given, lower-cased
      with spaces removed (``"1gbit"`` -> ``comm/inter/seconds_at_1gbit``).

    Counts are **this rank's own** (no cross-rank reduction, which would itself cost communication); the loggers only
    write rank 0's values. The loggers receive exactly the steps this callback logs, at the 0-based index of the
    optimizer step (the Trainer's own ``log_every_n_steps`` does not apply); ``trainer.callback_metrics`` (and the
    progress bar) hold the latest values as float64 tensors on the CPU, exact up to 2**53 bytes.

    Which labels: every label in ``labels`` is always logged (zeros when it had no traffic, e.g. a single process);
    with ``labels=None``, every label that has had traffic since the fit began (or has restored totals) is logged,
    so a single-process run without communication logs nothing.

    Args:
        bandwidths: Link rates to project onto, in ``tc`` syntax (``"1gbit"``, ``"100mbit"``, ``"10mbps"`` = bytes/s);
            see :func:`lightning_hetero.comm.parse_bandwidth`.
        labels: Labels to always log; None logs every label seen.
        log_every_n_steps: Log after every n-th optimizer step (counting from the first).
        prog_bar: Also show the metrics in the progress bar.

    Example (LightningCLI YAML)::

        trainer:
          callbacks:
            - class_path: lightning_hetero.callbacks.CommunicationMonitor
              init_args:
                bandwidths: ["1gbit", "100mbit"]
                labels: ["inter"]
    """

    def __init__(
        self,
        bandwidths: Sequence[str] = ("1gbit", "100mbit"),
        labels: Sequence[str] | None = None,
        log_every_n_steps: int = 1,
        prog_bar: bool = False,
    ) -> None:
        if isinstance(bandwidths, str):
            bandwidths = [bandwidths]  # a lone "1gbit" would otherwise be iterated character by character
        self.bits_per_second: dict[str, float] = {}
        for bandwidth in bandwidths:
            try:
                self.bits_per_second[str(bandwidth).lower().replace(" ", "")] = parse_bandwidth(bandwidth)
            except ValueError as error:
                raise ValueError(f"CommunicationMonitor(bandwidths=...): {error}") from None
        if labels is not None:
            for label in labels:
                try:
                    validate_label(label)
                except ValueError as error:
                    raise ValueError(f"CommunicationMonitor(labels=...): {error}") from None
        if log_every_n_steps < 1:
            raise ValueError(f"CommunicationMonitor(log_every_n_steps={log_every_n_steps}) must be >= 1.")
        self.bandwidths = list(bandwidths)
        self.labels = None if labels is None else list(labels)
        self.log_every_n_steps = log_every_n_steps
        self.prog_bar = prog_bar
        self._totals: dict[str, LedgerTotals] = {}  # since fit start + restored
        self._ledger_seen: dict[str, LedgerTotals] = {}  # ledger cumulative totals at the last accounting
        self._step_at_batch_start = 0

    @property
    def ledger(self) -> ByteLedger:
        """The ledger this callback reads: the process-global one."""
        return get_ledger()

    def totals(self, label: str) -> LedgerTotals:
        """Cumulative totals of ``label`` as this callback reports them (since fit start, plus restored)."""
        return self._totals.get(label, LedgerTotals())

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Only traffic from here on counts toward this fit's totals.
        self._ledger_seen = {label: self.ledger.totals(label) for label in self.ledger.labels()}

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        self.ledger.set_step(trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_at_batch_start:
            return  # gradient accumulation: the optimizer step has not happened yet
        finished_step = self._step_at_batch_start
        self._accumulate_totals()
        if (finished_step + 1) % self.log_every_n_steps == 0:
            self._log_step(pl_module, finished_step)

    def _accumulate_totals(self) -> None:
        for label in self.ledger.labels():
            now = self.ledger.totals(label)
            before = self._ledger_seen.get(label, LedgerTotals())
            # A ledger.reset() since the last look makes the difference negative: count everything since the reset.
            delta = now - before if now.calls >= before.calls else now
            self._ledger_seen[label] = now
            if delta.calls:
                self._totals[label] = self.totals(label) + delta

    def _log_step(self, pl_module: LightningModule, step: int) -> None:
        step_totals = self.ledger.step_totals(step)
        labels = self.labels if self.labels is not None else list(self._totals)
        metrics: dict[str, float] = {}
        for label in labels:
            this_step = step_totals.get(label, LedgerTotals())
            metrics[f"comm/{label}/bytes_sent_step"] = this_step.sent
            metrics[f"comm/{label}/bytes_received_step"] = this_step.received
            metrics[f"comm/{label}/bytes_sent_total"] = self.totals(label).sent
            busiest_direction_bits = max(this_step.sent, this_step.received) * 8
            for name, bits_per_second in self.bits_per_second.items():
                metrics[f"comm/{label}/seconds_at_{name}"] = busiest_direction_bits / bits_per_second
        if not metrics:  # nothing communicated and no labels requested: no empty rows in the loggers
            return
        # callback_metrics and the progress bar go through self.log. The loggers are written directly, as
        # LearningRateMonitor does: self.log from a callback would repeat the last value at every step we skip.
        for name, value in metrics.items():
            pl_module.log(
                name,
                torch.tensor(value, dtype=torch.float64),
                on_step=True,
                on_epoch=False,
                prog_bar=self.prog_bar,
                logger=False,
                batch_size=1,
            )
        for logger in pl_module.trainer.loggers:
            logger.log_metrics({name: float(value) for name, value in metrics.items()}, step=step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"totals": {label: totals.to_dict() for label, totals in self._totals.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._totals = {
            label: LedgerTotals(int(v["sent"]), int(v["received"]), int(v["calls"]))
            for label, v in state_dict.get("totals", {}).items()
        }
