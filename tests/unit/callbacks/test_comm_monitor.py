"""CommunicationMonitor on a real tiny Trainer; traffic is injected into the global ledger from training_step."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_hetero.callbacks import CommunicationMonitor
from lightning_hetero.callbacks.comm_monitor import log_step_metrics
from lightning_hetero.comm import INTER, INTRA, PIPELINE, SETUP_STEP, LedgerTotals, get_ledger


class _TinyModule(LightningModule):
    """A linear model whose every micro-batch "sends" ``1000 * (batch_idx + 1)`` bytes on INTER (half received)."""

    def __init__(self, chatty: bool = True, constant_bytes: int | None = None) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.chatty = chatty
        self.constant_bytes = constant_bytes

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.chatty:
            sent = self.constant_bytes or 1000 * (batch_idx + 1)
            get_ledger().record("all_gather", INTER, payload_bytes=sent, sent=sent, received=sent // 2, group_size=2)
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=2)


@pytest.fixture(autouse=True)
def _fresh_global_ledger() -> Any:
    get_ledger().reset()
    get_ledger().set_step(0)
    yield
    get_ledger().reset()


def _fit(
    monitor: CommunicationMonitor,
    tmp_path: Path,
    module: LightningModule | None = None,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=trainer_kwargs.pop("max_steps", 4),
        logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[monitor],
        **trainer_kwargs,
    )
    trainer.fit(module or _TinyModule(), ckpt_path=ckpt_path)
    return trainer


def _logged_rows(trainer: Trainer, metric: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every row of the CSV logger that has ``metric``."""
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as csv_file:
        return [(int(row["step"]), float(row[metric])) for row in csv.DictReader(csv_file) if row.get(metric)]


def _metric(trainer: Trainer, name: str) -> float:
    value = trainer.callback_metrics[name]
    assert value.dtype == torch.float64, "byte counts are logged as float64 to stay exact"
    return value.item()


def test_logs_step_bytes_totals_and_projected_seconds(tmp_path: Path) -> None:
    trainer = _fit(CommunicationMonitor(bandwidths=["1gbit", "100mbit", "1mbps"]), tmp_path)
    # last optimizer step is batch_idx 3: 4000 bytes sent, 2000 received; total sent 1000+2000+3000+4000
    assert _metric(trainer, "comm/inter/bytes_sent_step") == 4000
    assert _metric(trainer, "comm/inter/bytes_received_step") == 2000
    assert _metric(trainer, "comm/inter/bytes_sent_total") == 10_000
    assert _metric(trainer, "comm/inter/seconds_at_1gbit") == 4000 * 8 / 1e9
    assert _metric(trainer, "comm/inter/seconds_at_100mbit") == 4000 * 8 / 1e8
    assert _metric(trainer, "comm/inter/seconds_at_1mbps") == 4000 / 1e6  # mbps is megaBYTES per second
    assert not any(name.startswith(f"comm/{INTRA}/") for name in trainer.callback_metrics)
    # every optimizer step reached the logger with its own bytes
    assert _logged_rows(trainer, "comm/inter/bytes_sent_step") == [(0, 1000), (1, 2000), (2, 3000), (3, 4000)]
    assert _logged_rows(trainer, "comm/inter/bytes_sent_total") == [(0, 1000), (1, 3000), (2, 6000), (3, 10_000)]
    # the callback stamped the ledger with the global step
    assert [get_ledger().step_totals(step)[INTER].sent for step in range(4)] == [1000, 2000, 3000, 4000]


def test_gradient_accumulation_sums_micro_batches_into_one_step(tmp_path: Path) -> None:
    monitor = CommunicationMonitor()
    trainer = _fit(monitor, tmp_path, max_steps=2, accumulate_grad_batches=2)
    # step 0 = micro-batches 0 and 1 (1000 + 2000), step 1 = micro-batches 2 and 3 (3000 + 4000)
    assert _logged_rows(trainer, "comm/inter/bytes_sent_step") == [(0, 3000), (1, 7000)]
    assert _logged_rows(trainer, "comm/inter/bytes_received_step") == [(0, 1500), (1, 3500)]
    assert _metric(trainer, "comm/inter/bytes_sent_total") == 10_000
    assert _metric(trainer, "comm/inter/seconds_at_100mbit") == 7000 * 8 / 1e8
    assert monitor.totals(INTER) == LedgerTotals(sent=10_000, received=5000, calls=4)


def test_log_every_n_steps(tmp_path: Path) -> None:
    trainer = _fit(CommunicationMonitor(log_every_n_steps=2), tmp_path)
    assert _logged_rows(trainer, "comm/inter/bytes_sent_step") == [(1, 2000), (3, 4000)]
    assert _logged_rows(trainer, "comm/inter/bytes_sent_total") == [(1, 3000), (3, 10_000)]


def test_without_traffic_requested_labels_log_zeros_and_others_nothing(tmp_path: Path) -> None:
    quiet = _TinyModule(chatty=False)
    trainer = _fit(CommunicationMonitor(labels=[INTER, INTRA, PIPELINE]), tmp_path, module=quiet)
    for label in (INTER, INTRA, PIPELINE):
        for suffix in ("bytes_sent_step", "bytes_received_step", "bytes_sent_total", "seconds_at_1gbit"):
            assert _metric(trainer, f"comm/{label}/{suffix}") == 0.0
    trainer = _fit(CommunicationMonitor(), tmp_path / "unlabelled", module=_TinyModule(chatty=False))
    assert not any(name.startswith("comm/") for name in trainer.callback_metrics)
    metrics_file = Path(trainer.logger.log_dir) / "metrics.csv"
    assert not metrics_file.exists() or not list(csv.DictReader(metrics_file.open())), "no empty logger rows"


@pytest.mark.filterwarnings("ignore:You.re resuming from a checkpoint that ended before the epoch ended")
def test_totals_count_only_this_fit_and_survive_a_checkpoint(tmp_path: Path) -> None:
    get_ledger().record("send", INTER, payload_bytes=99, sent=99, received=0, group_size=2)  # before fit: ignored
    first = CommunicationMonitor()
    trainer = _fit(first, tmp_path, module=_TinyModule(constant_bytes=1000), max_steps=2)
    assert _metric(trainer, "comm/inter/bytes_sent_total") == 2000
    checkpoint = tmp_path / "half.ckpt"
    trainer.save_checkpoint(checkpoint)

    resumed = CommunicationMonitor()
    trainer = _fit(resumed, tmp_path, module=_TinyModule(constant_bytes=1000), max_steps=4, ckpt_path=str(checkpoint))
    assert _metric(trainer, "comm/inter/bytes_sent_step") == 1000
    assert _metric(trainer, "comm/inter/bytes_sent_total") == 4000  # 2 restored steps + 2 new ones


class _SetupChattyModule(_TinyModule):
    """Sends 5000 bytes in ``setup`` (like a strategy's initial broadcast), 300 per validation batch, 1000 per step."""

    def setup(self, stage: str) -> None:
        get_ledger().record("broadcast", INTER, payload_bytes=5000, sent=5000, received=0, group_size=2)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        get_ledger().record("all_reduce", INTER, payload_bytes=300, sent=300, received=300, group_size=2)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2)


def test_setup_traffic_is_its_own_figure_and_total_is_the_sum_of_steps(tmp_path: Path) -> None:
    get_ledger().set_step(0)  # a previous run left the ledger at step 0: fit start must still separate setup
    monitor = CommunicationMonitor()
    trainer = _fit(
        monitor,
        tmp_path,
        module=_SetupChattyModule(constant_bytes=1000),
        num_sanity_val_steps=1,
        limit_val_batches=1,
        val_check_interval=2,
    )
    # step 0 is like every other step; its projected seconds too
    assert _logged_rows(trainer, "comm/inter/bytes_sent_step") == [(0, 1000), (1, 1000), (2, 1000), (3, 1000)]
    assert _logged_rows(trainer, "comm/inter/seconds_at_1gbit") == [(step, 1000 * 8 / 1e9) for step in range(4)]
    # total == sum of the steps
    assert _logged_rows(trainer, "comm/inter/bytes_sent_total") == [(0, 1000), (1, 2000), (2, 3000), (3, 4000)]
    # setup (the broadcast in setup() plus the sanity-check validation batch) is logged once, with the first step
    assert _logged_rows(trainer, "comm/inter/bytes_sent_setup") == [(0, 5300)]
    assert _logged_rows(trainer, "comm/inter/bytes_received_setup") == [(0, 300)]
    assert monitor.setup_totals(INTER) == LedgerTotals(sent=5300, received=300, calls=2)
    # validation after step 1 is neither setup nor a step
    assert _logged_rows(trainer, "comm/inter/bytes_sent_between_steps") == [(0, 0), (1, 0), (2, 300), (3, 300)]
    assert monitor.totals(INTER) == LedgerTotals(sent=4000, received=2000, calls=4)
    assert monitor.coverage == ""  # a single process: nothing crosses a process boundary, no note
    # the ledger itself keeps setup traffic out of step 0's bucket
    assert get_ledger().step_totals(SETUP_STEP)[INTER] == LedgerTotals(sent=5300, received=300, calls=2)
    assert get_ledger().step_totals(0)[INTER] == LedgerTotals(sent=1000, received=500, calls=1)


def test_a_second_fit_in_the_same_process_counts_its_own_steps(tmp_path: Path) -> None:
    _fit(CommunicationMonitor(), tmp_path / "first", module=_TinyModule(constant_bytes=1000), max_steps=2)
    trainer = _fit(CommunicationMonitor(), tmp_path / "second", module=_TinyModule(constant_bytes=10), max_steps=2)
    # the ledger's step-0 bucket now holds both fits; the callback reports only this fit's step
    assert _logged_rows(trainer, "comm/inter/bytes_sent_step") == [(0, 10), (1, 10)]
    assert _logged_rows(trainer, "comm/inter/bytes_sent_total") == [(0, 10), (1, 20)]


def test_state_dict_round_trip() -> None:
    monitor = CommunicationMonitor()
    monitor.load_state_dict({"totals": {INTER: {"sent": 5, "received": 6, "calls": 7}}})  # a checkpoint of before
    assert monitor.totals(INTER) == LedgerTotals(5, 6, 7)
    assert monitor.between_steps_totals(INTER) == LedgerTotals()
    monitor.load_state_dict({**monitor.state_dict(), "between_steps": {INTER: {"sent": 1, "received": 2, "calls": 3}}})
    assert monitor.state_dict() == {
        "totals": {INTER: {"sent": 5, "received": 6, "calls": 7}},
        "between_steps": {INTER: {"sent": 1, "received": 2, "calls": 3}},
    }
    copy = CommunicationMonitor()
    copy.load_state_dict(monitor.state_dict())
    assert copy.totals(INTER) == LedgerTotals(5, 6, 7)
    assert copy.between_steps_totals(INTER) == LedgerTotals(1, 2, 3)
    assert copy.totals(INTRA) == LedgerTotals()


@pytest.mark.parametrize("bad", ["100 furlongs", "", "0mbit", "-1gbit"])
def test_bad_bandwidth_fails_at_construction_naming_the_argument(bad: str) -> None:
    with pytest.raises(ValueError, match=r"CommunicationMonitor\(bandwidths=\.\.\.\): Invalid bandwidth") as error:
        CommunicationMonitor(bandwidths=["1gbit", bad])
    assert repr(bad) in str(error.value)


def test_other_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"CommunicationMonitor\(labels=\.\.\.\)"):
        CommunicationMonitor(labels=[""])
    with pytest.raises(ValueError, match=r"CommunicationMonitor\(stock_label=\.\.\.\)"):
        CommunicationMonitor(stock_label="")
    with pytest.raises(ValueError, match=r"log_every_n_steps=0"):
        CommunicationMonitor(log_every_n_steps=0)
    assert CommunicationMonitor(bandwidths="1gbit").bits_per_second == {"1gbit": 1e9}  # type: ignore[arg-type]
    assert CommunicationMonitor().bits_per_second == {"1gbit": 1e9, "100mbit": 1e8}


class _EveryOtherStep(Callback):
    """Logs two metrics after every other optimizer step through :func:`log_step_metrics`."""

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step - 1
        if step % 2 == 0:
            metrics = {"probe/mean": 0.5 + step, "probe/layer": 2**53 + step}
            log_step_metrics(pl_module, metrics, step, prog_bar=lambda name: name.endswith("/mean"))


def test_log_step_metrics_writes_the_loggers_at_the_given_steps_only_and_callback_metrics_in_float64(tmp_path: Path):
    trainer = _fit(_EveryOtherStep(), tmp_path, module=_TinyModule(chatty=False), max_steps=5)
    assert _logged_rows(trainer, "probe/mean") == [(0, 0.5), (2, 2.5), (4, 4.5)]  # no repeats at skipped steps
    assert [step for step, _ in _logged_rows(trainer, "probe/layer")] == [0, 2, 4]
    layer = trainer.callback_metrics["probe/layer"]
    assert layer.dtype == torch.float64 and int(layer.item()) == 2**53 + 4
    assert set(trainer.progress_bar_metrics) == {"probe/mean"}


def test_a_strategys_step_bytes_are_left_to_an_attached_monitor():
    from types import SimpleNamespace

    from lightning_hetero.strategies.metric_names import without_callback_metrics

    metrics = {"comm/inter/bytes_sent_step": 7.0, "comm/hidden_fraction": 0.5, "comm/flip_bytes_sent": 3.0}
    every = CommunicationMonitor()
    assert every.logs_metric("comm/inter/bytes_sent_step") and not every.logs_metric("comm/hidden_fraction")
    assert not every.logs_metric("comm/flip_bytes_sent")  # not a per-label name: the strategy's own
    assert without_callback_metrics(SimpleNamespace(callbacks=[every]), metrics) == {
        "comm/hidden_fraction": 0.5,
        "comm/flip_bytes_sent": 3.0,
    }
    intra_only = CommunicationMonitor(labels=["intra"])  # does not log inter: the strategy keeps its value
    assert without_callback_metrics(SimpleNamespace(callbacks=[intra_only]), metrics) == metrics
    assert without_callback_metrics(SimpleNamespace(callbacks=[]), metrics) == metrics
    assert without_callback_metrics(None, metrics) == metrics
