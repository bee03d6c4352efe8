"""The DGL (``layerwise``) runtime on spawned gloo ranks: parity with one process, exact bytes, asynchronous bounds.

Each worker builds the same seeded tiny Llama (or CNN), keeps its own stage and trains a few steps through
:class:`~lightning_hetero.layerwise.dgl_runtime.DecoupledRuntime`. The parent runs the reference in ONE process:
every stage's own copy of the model and head, each block trained with its local loss on the detached output of the
block before it, step by step. Synchronous mode must match it bit for bit (same ops, lossless fp32 transport).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero import comm
from lightning_hetero.layerwise.decoupled import header_bytes
from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
from lightning_hetero.layerwise.loss_report import LOSS_LABEL
from lightning_hetero.layerwise.settings import LayerwiseSettings
from lightning_hetero.pipeline.settings import PipelineSettings
from lightning_hetero.testing import run_distributed

VOCAB, HIDDEN, SEQ, BATCH, STEPS = 64, 32, 12, 8, 3


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1, stride=2), nn.ReLU(),
        nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10),
    )  # fmt: skip


def _batches(kind: str, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        if kind == "llama":
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
            labels = ids.clone()
            labels[0, 6:] = -100
            batches.append({"input_ids": ids, "labels": labels})
        else:
            pixels = torch.randn(BATCH, 1, 8, 8, generator=generator)
            batches.append({"pixel_values": pixels, "labels": torch.randint(0, 10, (BATCH,), generator=generator)})
    return batches


def _holder(kind: str) -> nn.Module:
    holder = nn.Module()
    holder.model = _llama() if kind == "llama" else _cnn()
    return holder


def _train_worker(rank: int, world_size: int, kind: str, options: dict[str, Any], steps: int) -> dict[str, Any]:
    """``options``: fields of :class:`LayerwiseSettings` and of its ``pipeline`` (default: one stage per rank)."""
    options = dict(options)
    pipeline = {
        name: options.pop(name) for name in ("num_stages", "data_parallel_size", "boundary_dtype") if name in options
    }
    pipeline.setdefault("num_stages", world_size)
    runtime = DecoupledRuntime(LayerwiseSettings(pipeline=PipelineSettings(**pipeline), **options))
    holder = _holder(kind)
    runtime.setup(holder, torch.device("cpu"), rank)
    optimizer = torch.optim.SGD(runtime.stage.parameters(), lr=0.1)
    dp_rank = runtime.layout.dp_rank_of(rank)
    batches = _batches(kind, steps, seed=dp_rank)
    losses, staleness, step_bytes = [], [], []
    ledger = comm.get_ledger()
    for step, batch in enumerate(batches):
        ledger.set_step(step)
        losses.append(runtime.train_step(batch).item())
        staleness.append(runtime.last_staleness)
        optimizer.step()
        optimizer.zero_grad()
    runtime.flush()
    for step in range(steps):
        totals = ledger.step_totals(step).get(comm.PIPELINE, comm.LedgerTotals())
        step_bytes.append((totals.sent, totals.received))
    intra = ledger.totals(comm.INTRA).sent
    loss_report = ledger.totals(LOSS_LABEL)
    ledger.set_step(steps)
    val = runtime.eval_step(_batches(kind, 1, seed=99)[0]).item()
    return {
        "stage": runtime.stage_index,
        "losses": losses,
        "state": {k: v.clone() for k, v in runtime.stage.state_dict().items()},
        "bytes": step_bytes,
        "intra": intra,
        "loss_report": (loss_report.sent, loss_report.received),
        "model_loss": runtime.model_loss,
        "staleness": staleness,
        "buffer": runtime.buffer.stats(),
        "val": val,
    }


def _reference(kind: str, num_stages: int, steps: int, aux_head: str = "linear") -> list[dict[str, Any]]:
    """Every stage's copy of the model in one process, each block trained on the detached previous output."""

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks: conv backward sums in another order with more threads
    try:
        return _reference_steps(kind, num_stages, steps, aux_head)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(kind: str, num_stages: int, steps: int, aux_head: str) -> list[dict[str, Any]]:
    from lightning_hetero.layerwise.dgl_stage import build_dgl_stage

    parts = []
    for stage in range(num_stages):
        holder = _holder(kind)
        stack, container = build_dgl_stage(holder, num_stages, stage, None, aux_head, None, torch.device("cpu"))
        parts.append((stack, container, torch.optim.SGD(container.parameters(), lr=0.1)))
    losses: list[list[float]] = [[] for _ in range(num_stages)]
    for batch in _batches(kind, steps, seed=0):
        x = None
        for stage, (stack, container, optimizer) in enumerate(parts):
            hidden = container.block(stack.embed(batch) if x is None else x, stack.context_of(batch))
            loss = stack.loss(container.head(hidden), batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[stage].append(loss.item())
            x = hidden.detach()
    return [{"losses": losses[s], "state": parts[s][1].state_dict()} for s in range(num_stages)]


@pytest.mark.parametrize("kind", ["llama", pytest.param("cnn", marks=pytest.mark.slow)])
def test_sync_dgl_equals_one_process_and_counts_bytes(kind: str) -> None:
    results = run_distributed(_train_worker, 2, kind, {}, STEPS, timeout=300)
    reference = _reference(kind, 2, STEPS)
    for result, expected in zip(results, reference, strict=True):
        assert result["losses"] == expected["losses"]  # bit for bit
        for name, value in expected["state"].items():
            assert torch.equal(result["state"][name], value), name
    first, second = results
    # Forward only: stage 0 sends one activation tensor per step, stage 1 sends nothing back; the per-sample shape
    # header (64 bytes) goes once, with the first batch.
    payload = BATCH * SEQ * HIDDEN * 4 if kind == "llama" else BATCH * 6 * 4 * 4 * 4
    assert first["bytes"] == [(payload + header_bytes(), 0)] + [(payload, 0)] * (STEPS - 1)
    assert second["bytes"] == [(0, payload + header_bytes())] + [(0, payload)] * (STEPS - 1)
    assert first["val"] == second["val"] and first["val"] > 0
    # the last stage's loss goes to rank 0 (its progress bar), 16 bytes a step, counted as a metric
    assert second["loss_report"] == (16 * STEPS, 0) and first["loss_report"] == (0, 16 * STEPS)
    assert first["model_loss"] == second["model_loss"] == second["losses"][-1]


@pytest.mark.slow
def test_bf16_and_int8_activation_bytes() -> None:
    for codec, per_token in (("bf16", HIDDEN * 2), ("int8", 4 * (HIDDEN // 4) + 4)):
        first, second = run_distributed(_train_worker, 2, "llama", {"boundary_dtype": codec}, 2, timeout=180)
        assert first["bytes"][1] == (BATCH * SEQ * per_token, 0), codec
        assert second["losses"][0] > 0


def test_async_mode_bounds_staleness_and_drains() -> None:
    options = {"mode": "async", "replay_capacity": 2, "num_stages": 3}
    results = run_distributed(_train_worker, 3, "llama", options, 6, timeout=400)
    for result in results:
        assert all(0 <= s < 2 for s in result["staleness"]), result["staleness"]
        assert result["buffer"]["size"] <= 2
    first = results[0]
    payload = BATCH * SEQ * HIDDEN * 4 + header_bytes()  # a header with every message in asynchronous mode
    assert first["bytes"] == [(payload, 0)] * 6
    assert sum(received for _, received in results[2]["bytes"]) == 6 * payload  # every message drained by flush
    assert results[0]["staleness"] == [0] * 6  # stage 0 reads its own batches


@pytest.mark.slow
def test_data_parallel_inside_a_stage_averages_gradients() -> None:
    results = run_distributed(_train_worker, 4, "cnn", {"num_stages": 2, "data_parallel_size": 2}, 2, timeout=240)
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for result in results:
        by_stage.setdefault(result["stage"], []).append(result)
    for replicas in by_stage.values():
        a, b = replicas
        assert a["losses"] != b["losses"]  # different data shards ...
        for name, value in a["state"].items():
            assert torch.equal(value, b["state"][name]), name  # ... yet equal weights after averaged steps
        assert a["intra"] > 0
