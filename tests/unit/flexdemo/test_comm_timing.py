"""A FlexDeMo Trainer step in the fault-tolerant mode logs timing that fits inside the step, and hides nothing.

The Manager's exchange is synchronous, so ``comm/hidden_fraction`` is 0 and ``comm/comm_seconds`` (read on the
monotonic wall clock from the exchange's start) is at most the step's wall-clock time. One replica group on a real
lighthouse in the pytest process (see tests/unit/flexdemo/test_fault_tolerant.py).
"""

from __future__ import annotations

import lightning as L
import pytest

from lightning_hetero.comm.timing import wall_clock
from tests.fixtures import quiet_trainer
from tests.unit.flexdemo.test_fault_tolerant import _data, _ft, _Regression, _trainer_strategy, lighthouse  # noqa: F401


class _StepClock(L.Callback):
    """Each training step's wall-clock time and the comm/* metrics the strategy logged for it."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._began = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._began = wall_clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")}
        self.steps.append({"wall": wall_clock() - self._began, **metrics})


@pytest.mark.timeout(180)
def test_fault_tolerant_comm_seconds_fit_in_the_step_and_nothing_is_hidden(lighthouse):  # noqa: F811
    clock = _StepClock()
    trainer = quiet_trainer(devices=1, strategy=_trainer_strategy(_ft(lighthouse)), max_steps=2, callbacks=[clock])
    trainer.fit(_Regression(), _data())
    assert len(clock.steps) == 2
    for step in clock.steps:
        assert 0.0 < step["comm/comm_seconds"] <= step["wall"], step
        assert step["comm/wait_seconds"] == pytest.approx(step["comm/comm_seconds"]), step
        assert step["comm/hidden_fraction"] == 0.0, step
        assert step["comm/inter/bytes_sent_step"] == 0.0, step  # a replica alone sends nothing
