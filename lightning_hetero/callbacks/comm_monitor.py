"""Log what each optimizer step put on the wire, and how long that would take on a slow link.

:class:`CommunicationMonitor` is a thin Lightning view over the process-global
:class:`~lightning_hetero.comm.ByteLedger`. It cuts the ledger's traffic at step boundaries: setup (fit start until the
first training batch), each optimizer step (all its micro-batches), and what falls between steps (validation). It
also counts stock DDP's gradient all-reduce (:mod:`lightning_hetero.comm.ddp_hook`) and FSDP2's all-gathers and
reduce-scatters (:mod:`lightning_hetero.comm.fsdp_comm`); what it cannot count (FSDP1, Lightning's own metric syncs)
it states once at fit start (:func:`describe_coverage`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_hetero.comm.ddp_hook import ddp_uncounted_traffic, register_counted_allreduce
from lightning_hetero.comm.fsdp_comm import count_fsdp2
from lightning_hetero.comm.ledger import INTER, INTRA, SETUP_STEP, ByteLedger, LedgerTotals, get_ledger, validate_label
from lightning_hetero.comm.units import parse_bandwidth

__all__ = ["CommunicationMonitor", "describe_coverage", "log_step_metrics"]

_SETUP, _STEP, _BETWEEN = "setup", "step", "between"  # where the traffic since the last boundary belongs


def log_step_metrics(
    pl_module: LightningModule,
    metrics: Mapping[str, float],
    step: int,
    *,
    prog_bar: bool | Callable[[str], bool] = False,
) -> None:
    """Log a callback's values of one optimizer step, for callbacks that log only every n-th step.

    ``trainer.callback_metrics`` (and the progress bar, for the names ``prog_bar`` selects) get float64 CPU tensors
    through ``pl_module.log``, exact up to 2**53. The loggers are written directly at ``step``, as LearningRateMonitor
    does: ``self.log`` from a callback would repeat the last value at every step the callback skips.

    Args:
        pl_module: The module being trained (its ``log`` and its trainer's loggers are used).
        metrics: ``{name: value}`` of this step.
        step: The logger step, e.g. the 0-based index of the optimizer step that just finished.
        prog_bar: Show every value in the progress bar (``True``), none (``False``), or those whose name it accepts.
    """
    for name, value in metrics.items():
        pl_module.log(
            name,
            torch.tensor(value, dtype=torch.float64),
            on_step=True,
            on_epoch=False,
            prog_bar=prog_bar(name) if callable(prog_bar) else prog_bar,
            logger=False,
            batch_size=1,
        )
    for logger in pl_module.trainer.loggers:
        logger.log_metrics({name: float(value) for name, value in metrics.items()}, step=step)


class CommunicationMonitor(Callback):
    """Log bytes sent and received per link label, per optimizer step, plus projected transfer time.

    For every label, after every ``log_every_n_steps``-th optimizer step, it logs:

    - ``comm/{label}/bytes_sent_step`` and ``comm/{label}/bytes_received_step``: bytes of the step that just
      finished, from the start of its first micro-batch to the end of its last (including the optimizer step);
    - ``comm/{label}/bytes_sent_total``: the sum of ``bytes_sent_step`` over every optimizer step since the fit
      began (logged or not), plus the totals restored from a checkpoint;
    - ``comm/{label}/bytes_sent_setup`` and ``comm/{label}/bytes_received_setup``, once, with the first logged step:
      traffic from the start of the fit to its first training batch (a strategy's initial model broadcast, checkpoint
      restore, the sanity check), never part of a step or the total;
    - ``comm/{label}/bytes_sent_between_steps``: traffic after setup but outside optimizer steps (validation, the
      end of an epoch), cumulative since the fit began plus restored;
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

    What is counted: every call of :mod:`lightning_hetero.comm` (all traffic of our strategies' algorithms); stock
    ``DistributedDataParallel``'s gradient all-reduce, measured bucket by bucket through a DDP comm hook this callback
    registers; and FSDP2's (``fully_shard``, including FlexDeMo's intra-node shard group) all-gathers and
    reduce-scatters, measured per call through the custom comms FSDP2 accepts (label ``stock_label`` for both).
    Not counted, and stated once at fit start on rank 0 (also in :attr:`coverage`): FSDP1's collectives, DDP's
    buffer broadcasts, HSDP's replicate all-reduce, other strategies' own collectives and Lightning's
    (``self.log(sync_dist=True)``, ``strategy.broadcast``/``barrier``).

    Args:
        bandwidths: Link rates to project onto, in ``tc`` syntax (``"1gbit"``, ``"100mbit"``, ``"10mbps"`` = bytes/s);
            see :func:`lightning_hetero.comm.parse_bandwidth`.
        labels: Labels to always log; None logs every label seen.
        log_every_n_steps: Log after every n-th optimizer step (counting from the first).
        prog_bar: Also show the metrics in the progress bar.
        stock_label: Label of the stock DDP / FSDP2 traffic this callback counts; None: ``"inter"`` when the group
            has more ranks than one node, else ``"intra"``.

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
        stock_label: str | None = None,
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
        if stock_label is not None:
            try:
                validate_label(stock_label)
            except ValueError as error:
                raise ValueError(f"CommunicationMonitor(stock_label=...): {error}") from None
        if log_every_n_steps < 1:
            raise ValueError(f"CommunicationMonitor(log_every_n_steps={log_every_n_steps}) must be >= 1.")
        self.bandwidths = list(bandwidths)
        self.labels = None if labels is None else list(labels)
        self.log_every_n_steps = log_every_n_steps
        self.prog_bar = prog_bar
        self.stock_label = stock_label
        self._totals: dict[str, LedgerTotals] = {}  # sum of optimizer steps since fit start + restored
        self._between: dict[str, LedgerTotals] = {}  # outside steps after setup, since fit start + restored
        self._setup: dict[str, LedgerTotals] = {}  # this fit's setup
        self._setup_logged = False
        self._snapshot: dict[str, LedgerTotals] = {}  # ledger cumulative totals at the last boundary
        self._phase = _SETUP
        self._step_at_batch_start = 0
        self._coverage = ""

    def logs_metric(self, name: str) -> bool:
        """Whether this callback logs ``name`` (a ``comm/{label}/bytes_*`` name of a label it logs).

        Strategies that report their step's bytes under the same names leave them to this callback when it is
        attached (one name per meaning, one source: docs/metrics.md).
        """
        parts = name.split("/")
        if len(parts) != 3 or parts[0] != "comm" or not parts[2].startswith("bytes_"):
            return False
        return self.labels is None or parts[1] in self.labels

    @property
    def ledger(self) -> ByteLedger:
        """The ledger this callback reads: the process-global one."""
        return get_ledger()

    def totals(self, label: str) -> LedgerTotals:
        """Cumulative totals of ``label`` as this callback reports them (since fit start, plus restored)."""
        return self._totals.get(label, LedgerTotals())

    def setup_totals(self, label: str) -> LedgerTotals:
        """This fit's setup traffic of ``label``: from fit start until its first training batch."""
        return self._setup.get(label, LedgerTotals())

    def between_steps_totals(self, label: str) -> LedgerTotals:
        """Traffic of ``label`` after setup outside optimizer steps (e.g. validation): since fit start + restored."""
        return self._between.get(label, LedgerTotals())

    @property
    def coverage(self) -> str:
        """What this fit's metrics count and what they do not (stated once at fit start, on rank 0)."""
        return self._coverage

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Runs before the strategy's setup: its initial broadcast and the sanity check are setup traffic.
        self.ledger.set_step(SETUP_STEP)
        self._snapshot = self._ledger_totals()
        self._phase = _SETUP
        self._setup = {}
        self._setup_logged = False

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._coverage = describe_coverage(trainer, self.stock_label, count_stock=True)
        if self._coverage:
            rank_zero_info(self._coverage)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._phase != _STEP:  # the first micro-batch of an optimizer step: close what came before
            delta = self._take_delta()
            target = self._setup if self._phase == _SETUP else self._between
            for label, totals in delta.items():
                target[label] = target.get(label, LedgerTotals()) + totals
            self._phase = _STEP
        self._step_at_batch_start = trainer.global_step
        self.ledger.set_step(trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_at_batch_start:
            return  # gradient accumulation: the optimizer step has not happened yet
        finished_step = self._step_at_batch_start
        this_step = self._take_delta()
        for label, totals in this_step.items():
            self._totals[label] = self.totals(label) + totals
        self._phase = _BETWEEN
        if (finished_step + 1) % self.log_every_n_steps == 0:
            self._log_step(pl_module, finished_step, this_step)

    def _ledger_totals(self) -> dict[str, LedgerTotals]:
        return {label: self.ledger.totals(label) for label in self.ledger.labels()}

    def _take_delta(self) -> dict[str, LedgerTotals]:
        """Traffic per label since the last boundary; moves the boundary to now."""
        now = self._ledger_totals()
        delta = {}
        for label, totals in now.items():
            before = self._snapshot.get(label, LedgerTotals())
            # A ledger.reset() since the last look makes the difference negative: count everything since the reset.
            change = totals - before if totals.calls >= before.calls else totals
            if change.calls:
                delta[label] = change
        self._snapshot = now
        return delta

    def _log_step(self, pl_module: LightningModule, step: int, step_totals: dict[str, LedgerTotals]) -> None:
        seen = [*self._totals, *self._setup, *self._between]
        labels = self.labels if self.labels is not None else list(dict.fromkeys(seen))
        metrics: dict[str, float] = {}
        for label in labels:
            this_step = step_totals.get(label, LedgerTotals())
            metrics[f"comm/{label}/bytes_sent_step"] = this_step.sent
            metrics[f"comm/{label}/bytes_received_step"] = this_step.received
            metrics[f"comm/{label}/bytes_sent_total"] = self.totals(label).sent
            metrics[f"comm/{label}/bytes_sent_between_steps"] = self.between_steps_totals(label).sent
            if not self._setup_logged:
                metrics[f"comm/{label}/bytes_sent_setup"] = self.setup_totals(label).sent
                metrics[f"comm/{label}/bytes_received_setup"] = self.setup_totals(label).received
            busiest_direction_bits = max(this_step.sent, this_step.received) * 8
            for name, bits_per_second in self.bits_per_second.items():
                metrics[f"comm/{label}/seconds_at_{name}"] = busiest_direction_bits / bits_per_second
        if not metrics:  # nothing communicated and no labels requested: no empty rows in the loggers
            return
        self._setup_logged = True
        log_step_metrics(pl_module, metrics, step, prog_bar=self.prog_bar)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "totals": {label: totals.to_dict() for label, totals in self._totals.items()},
            "between_steps": {label: totals.to_dict() for label, totals in self._between.items()},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._totals = _totals_from(state_dict.get("totals", {}))
        self._between = _totals_from(state_dict.get("between_steps", {}))


def _totals_from(entries: dict[str, Any]) -> dict[str, LedgerTotals]:
    return {label: LedgerTotals(int(v["sent"]), int(v["received"]), int(v["calls"])) for label, v in entries.items()}


def describe_coverage(trainer: Trainer, stock_label: str | None = None, count_stock: bool = False) -> str:
    """What the ``comm/*`` metrics count in this run and what they do not; empty for a single process.

    Args:
        trainer: A Trainer whose strategy is set up (``on_fit_start`` or later).
        stock_label: Label for stock DDP's / FSDP2's traffic (None: ``"inter"`` when the group has more ranks than
            one node, else ``"intra"``).
        count_stock: Install the counting DDP comm hook and FSDP2 comms (:mod:`lightning_hetero.comm.ddp_hook`,
            :mod:`lightning_hetero.comm.fsdp_comm`) where the model uses stock DDP or ``fully_shard``.
    """
    if trainer.world_size <= 1:
        return ""
    strategy = trainer.strategy
    model = strategy.model if strategy.model is not None else trainer.lightning_module
    counted = ["every lightning_hetero.comm collective (all traffic of lightning_hetero's algorithms)"]
    missing: list[str] = []
    is_ddp = isinstance(model, DistributedDataParallel)
    if is_ddp:
        label = stock_label or _auto_label(trainer, trainer.world_size)
        if count_stock and _count_ddp_allreduce(model, label):
            counted.append(f"stock DDP's gradient all-reduce, measured per bucket (label {label!r})")
        else:
            missing.append("DDP's gradient all-reduce (another DDP comm hook is registered, e.g. ddp_comm_hook=)")
        missing.extend(ddp_uncounted_traffic(model))
    modules = list(model.modules()) if model is not None else []
    fsdp1 = sum(isinstance(module, FullyShardedDataParallel) for module in modules)
    if fsdp1:
        missing.append(f"FSDP's parameter all-gathers and gradient reduce-scatters ({fsdp1} FSDP unit(s))")
    shard_size = _fsdp2_shard_size(modules)
    if shard_size is not None and model is not None:
        label = stock_label or _auto_label(trainer, shard_size)
        coverage = count_fsdp2(model, label) if count_stock else None
        if coverage is not None and coverage.counted:
            counted.append(
                f"FSDP2 (fully_shard) parameter all-gathers and gradient reduce-scatters of {len(coverage.counted)} "
                f"module(s), measured per call (label {label!r}; under FlexDeMo, the intra-node shard group)"
            )
        uncounted = coverage.uncounted if coverage is not None else {"all": "counting not installed"}
        if uncounted:
            reasons = "; ".join(f"{name}: {why}" for name, why in uncounted.items())
            missing.append(f"FSDP2 (fully_shard) all-gathers and reduce-scatters of {reasons}")
        if coverage is not None and coverage.hsdp:
            missing.append(
                f"FSDP2's all-reduce across the replicate dimension of 2-D meshes ({len(coverage.hsdp)} mod.)"
            )
    ours = type(strategy).__module__.startswith("lightning_hetero.")
    if not (ours or is_ddp):
        missing.append(f"any other collective {type(strategy).__name__} issues (it does not use lightning_hetero.comm)")
    missing.append(
        "Lightning's own collectives: self.log(..., sync_dist=True) reductions and strategy.broadcast/barrier/"
        "all_gather"
    )
    return f"CommunicationMonitor counts {'; '.join(counted)}. NOT counted in comm/* metrics: {'; '.join(missing)}."


def _auto_label(trainer: Trainer, group_size: int) -> str:
    """``"inter"`` for a group larger than one node's ranks, else ``"intra"``."""
    return INTER if trainer.num_nodes > 1 and group_size > trainer.num_devices else INTRA


def _fsdp2_shard_size(modules: list[torch.nn.Module]) -> int | None:
    """Ranks of the FSDP2 shard group (the mesh's last dimension), or None without ``fully_shard`` modules."""
    for module in modules:
        if isinstance(module, FSDPModule):
            for parameter in module.parameters():
                mesh = getattr(parameter, "device_mesh", None)
                if mesh is not None:
                    return int(mesh.size(mesh.ndim - 1))
            return 1
    return None


def _count_ddp_allreduce(model: DistributedDataParallel, label: str) -> bool:
    """Register the counted all-reduce hook; False when DDP already has another comm hook (it allows only one)."""
    try:
        register_counted_allreduce(model, label)
    except RuntimeError:
        return False
    return True
