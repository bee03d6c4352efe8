"""``CommunicationMonitor`` added to a stock Trainer with a user's module (``usernets.UserLlama``) on 2 gloo ranks.

- Stock DDP: the gradient all-reduce is counted, bucket by bucket, and equals hand arithmetic: every gradient
  element (4 bytes, float32) all-reduced once per optimizer step, times the ledger's ring factor ``2*(n-1)/n`` (1 for
  ``n = 2``). What is not counted (DDP's buffer broadcast, Lightning's metric syncs) is said once, on rank 0.
- Stock FSDP2 (Lightning's ``ModelParallelStrategy``, the user's ``configure_model`` calling ``fully_shard``; stock
  ``FSDPStrategy`` refuses CPU): its all-gathers and reduce-scatters are counted and equal hand arithmetic; the note
  says, once, on rank 0, what that strategy may issue besides.
- FlexDeMo (one of ours): step 0's bytes equal a later step's, the initial model broadcast is reported as setup, and
  ``bytes_sent_total`` is the sum of the steps; an intra-node FSDP2 shard group's traffic is counted too.

The Trainers run inside one :func:`~lightning_hetero.testing.run_distributed` spawn (module-scoped fixture): the
process group exists already, so Lightning launches nothing and ``strategy="ddp"`` never runs in the pytest process.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import lightning_utilities.core.rank_zero as rank_zero_module
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from lightning_hetero import FlexDeMoSettings, FlexDeMoStrategy, ReplicationSettings
from lightning_hetero.callbacks import CommunicationMonitor
from lightning_hetero.comm import INTER, INTRA, get_ledger
from lightning_hetero.testing import run_distributed
from tests.usercode.usernets import UserLlama

pytestmark = pytest.mark.timeout(600)

STEPS = 3
DEMO_1_8 = ReplicationSettings(kind="demo", kept_fraction=1 / 8)
NOTE = "CommunicationMonitor counts"


class _StepMetrics(Callback):
    """The monitor's ``comm/*`` values after every optimizer step (runs after the monitor: later in the list)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        metrics = trainer.callback_metrics
        self.steps.append({k: float(v) for k, v in metrics.items() if k.startswith("comm/")})


class _Notes(logging.Handler):
    """Collects the messages ``rank_zero_info`` logs (the logger Lightning routes them to)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class UserLlamaFSDP2(UserLlama):
    """The same user module sharded the way Lightning's FSDP2 docs show: ``fully_shard`` in ``configure_model``."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _sum_by_op(records: Any) -> dict[str, int]:
    sums: dict[str, int] = {}
    for record in records:
        key = f"{record.op}/{record.label}"
        sums[key] = sums.get(key, 0) + record.sent
    return sums


def _fit(strategy: Any, module_class: type[UserLlama] = UserLlama) -> dict[str, Any]:
    monitor, recorder, notes = CommunicationMonitor(), _StepMetrics(), _Notes()
    logger = rank_zero_module.log
    logger.addHandler(notes)
    try:
        module = module_class(batch_size=4, train_items=64, val_items=8)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[monitor, recorder],
        )
        with get_ledger().capture() as seen:
            trainer.fit(module)
    finally:
        logger.removeHandler(notes)
    grads = sum(p.numel() for p in module.parameters() if p.requires_grad)  # global sizes, also for DTensors
    layers = sum(p.numel() for p in module.model.model.layers.parameters())
    return {
        "steps": recorder.steps,
        "coverage": monitor.coverage,
        "notes": [m for m in notes.messages if NOTE in m],
        "grad_elements": grads,
        "layer_elements": layers,
        "sent_by_op": [  # per optimizer step: bytes sent per (op, label), from the ledger's own records
            _sum_by_op(record for record in seen.records() if record.step == step) for step in range(STEPS)
        ],
        "setup": {label: monitor.setup_totals(label).sent for label in (INTER, INTRA)},
    }


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "ddp": _fit(DDPStrategy()),
        "fsdp": _fit(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), UserLlamaFSDP2),
        "flexdemo": _fit(FlexDeMoStrategy(settings=FlexDeMoSettings(replication=DEMO_1_8, shard_size=1))),  # 2 replicas
        "flexdemo_sharded": _fit(
            FlexDeMoStrategy(settings=FlexDeMoSettings(replication=DEMO_1_8, shard_size=2))
        ),  # 1 replica
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, timeout=540)


def test_stock_ddp_gradient_allreduce_is_counted_exactly(runs: list[dict[str, Any]]) -> None:
    n = 2
    for rank, result in enumerate(runs):
        ddp = result["ddp"]
        # float32 gradients, every element all-reduced once per step; ring rule: 2*(n-1)/n of S each way
        expected = ddp["grad_elements"] * 4 * 2 * (n - 1) // n
        assert len(ddp["steps"]) == STEPS
        for step, metrics in enumerate(ddp["steps"]):
            assert metrics["comm/intra/bytes_sent_step"] == expected, (rank, step)
            assert metrics["comm/intra/bytes_received_step"] == expected, (rank, step)
            assert metrics["comm/intra/bytes_sent_total"] == expected * (step + 1)
        assert ddp["setup"][INTRA] == 0  # DDP's initial broadcast happens outside any counted call
        assert "stock DDP's gradient all-reduce, measured per bucket (label 'intra')" in ddp["coverage"]
        assert "buffer" in ddp["coverage"] and "sync_dist" in ddp["coverage"]  # Llama's rotary inv_freq buffer
    assert runs[0]["ddp"]["notes"] == [runs[0]["ddp"]["coverage"]]  # said once, on rank 0 only
    assert runs[1]["ddp"]["notes"] == []


def test_stock_fsdp2_all_gathers_and_reduce_scatters_are_counted_exactly(runs: list[dict[str, Any]]) -> None:
    n = 2
    for rank, result in enumerate(runs):
        fsdp = result["fsdp"]
        # fp32, no padding (every dim0 is even). Reduce-scatter: every gradient element once, (n-1)/n of S each way.
        reduce_scatter = fsdp["grad_elements"] * 4 * (n - 1) // n
        # All-gather, (n-1) * this rank's 1/n shard: every parameter in forward, and the decoder layers again in
        # backward (resharded after forward; the root is not).
        all_gather = (fsdp["grad_elements"] + fsdp["layer_elements"]) * 4 * (n - 1) // n
        for step in range(STEPS):
            by_op = fsdp["sent_by_op"][step]
            assert by_op == {"all_gather_into_tensor/intra": all_gather, "reduce_scatter_tensor/intra": reduce_scatter}
            assert fsdp["steps"][step]["comm/intra/bytes_sent_step"] == all_gather + reduce_scatter, (rank, step)
        assert (
            "FSDP2 (fully_shard) parameter all-gathers and gradient reduce-scatters of 3 module(s)"
            in (fsdp["coverage"].split("NOT counted")[0])
        )
        assert "any other collective ModelParallelStrategy issues" in fsdp["coverage"].split("NOT counted")[1]
    assert runs[0]["fsdp"]["notes"] == [runs[0]["fsdp"]["coverage"]]  # said once, on rank 0 only
    assert runs[1]["fsdp"]["notes"] == []


def test_flexdemo_step_zero_is_a_step_like_the_others_and_setup_is_separate(runs: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(runs):
        flex = result["flexdemo"]
        sent = [metrics["comm/inter/bytes_sent_step"] for metrics in flex["steps"]]
        assert len(sent) == STEPS and sent[0] > 0
        assert sent[0] == sent[1] == sent[2], (rank, sent)  # fixed-size compressed payload every step
        totals = [metrics["comm/inter/bytes_sent_total"] for metrics in flex["steps"]]
        assert totals == [sum(sent[: step + 1]) for step in range(STEPS)]
        # the initial model broadcast from rank 0 (rank 1 only receives it)
        assert (flex["setup"][INTER] > 0) == (rank == 0)
        assert flex["steps"][0]["comm/inter/bytes_sent_setup"] == flex["setup"][INTER]
        assert "FSDP2" not in flex["coverage"]  # shard groups of one: FlexDeMo applies no FSDP2, nothing to miss


def test_flexdemo_intra_node_fsdp2_is_counted(runs: list[dict[str, Any]]) -> None:
    n = 2
    for result in runs:
        sharded = result["flexdemo_sharded"]
        reduce_scatter = sharded["grad_elements"] * 4 * (n - 1) // n
        per_step = [by_op["reduce_scatter_tensor/intra"] for by_op in sharded["sent_by_op"]]
        assert per_step == [reduce_scatter] * STEPS
        gathers = [by_op["all_gather_into_tensor/intra"] for by_op in sharded["sent_by_op"]]
        assert gathers[0] >= sharded["grad_elements"] * 4 * (n - 1) // n and len(set(gathers)) == 1
        sent = [metrics["comm/intra/bytes_sent_step"] for metrics in sharded["steps"]]
        assert sent == [gathers[0] + reduce_scatter] * STEPS
        assert "under FlexDeMo, the intra-node shard group" in sharded["coverage"].split("NOT counted")[0]
    assert runs[0]["flexdemo_sharded"]["notes"] == [runs[0]["flexdemo_sharded"]["coverage"]]
    assert runs[1]["flexdemo_sharded"]["notes"] == []
