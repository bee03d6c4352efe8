"""Spawned-rank measurements for ``recipes/sparseflip/bench_lowbit.py``: bytes per step, and distributed flip training.

:func:`measure` gives the bytes per step of the ``sparseflip`` exchange next to a dense fp32 all-reduce.
:func:`train_distributed` trains the small MNIST / digits classifiers of :mod:`lowbit_experiments`
with the strategy's runtime on ``workers`` ranks (each rank its share of every batch) and reports test accuracy
and bytes, so the sparse exchange's effect on accuracy can be compared with single-process flip training.

Each of ``workers`` spawned CPU ranks builds the same model, converts it like the strategy does, and runs a few
steps of the strategy's runtime (:class:`~lightning_hetero.sparseflip.runtime.SparseFlipRuntime`) on its own batch; the
ledger records every byte each rank puts on the wire and receives. The baseline is what DDP sends for the same model
before conversion: one fp32 all-reduce of every parameter, run through the same counted collectives and measured
the same way (the ledger uses the ring formula, 2 (n - 1) / n of the payload each way per rank). Used by
``recipes/sparseflip/bench_lowbit.py``; framework-free apart from the model builders.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_hetero import comm
from lightning_hetero.testing import run_distributed


def sparseflip_settings(options: Mapping[str, Any]) -> Any:
    """The :class:`~lightning_hetero.sparseflip.settings.SparseFlipSettings` of a JSON-able options mapping, written as
    in a YAML ``init_args.settings``: ``{"flip": {"rule": "topk"}, "exchange": {"kept_fraction": 0.01}}``."""
    from lightning_hetero.sparseflip import CodeExchangeSettings, FlipSettings, FpSyncSettings, SparseFlipSettings

    groups = {"flip": FlipSettings, "exchange": CodeExchangeSettings, "fp_sync": FpSyncSettings}
    return SparseFlipSettings(**{k: groups[k](**v) if k in groups else v for k, v in options.items()})


def build_vit() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The ``vit-tiny`` image classifier of ``configs/sparseflip_vit_mnist.yaml`` (patch 7) and a random batch."""
    from transformers import ViTForImageClassification

    from lightning_hetero.models.presets import build_config

    torch.manual_seed(0)
    model = ViTForImageClassification(build_config("vit-tiny", {"patch_size": 7}))
    x = torch.randn(64, 1, 28, 28)
    return model, x, torch.randint(0, 10, (64,))


def _worker(rank: int, world: int, options: dict[str, Any], steps: int) -> dict[str, Any]:
    from lightning_hetero.sparseflip.runtime import SparseFlipRuntime

    model, x, y = build_vit()
    dense_numel = sum(p.numel() for p in model.parameters())
    ledger = comm.get_ledger()
    before = ledger.totals(comm.INTER)
    comm.all_reduce(torch.zeros(dense_numel), "sum", label=comm.INTER)  # what DDP moves for this model, once
    after = ledger.totals(comm.INTER)
    dense = {"sent": after.sent - before.sent, "received": after.received - before.received}
    runtime = SparseFlipRuntime(sparseflip_settings(options))
    runtime.setup(model, torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    sent, received = [], []
    for _ in range(steps):
        index = torch.randint(0, x.shape[0], (32,), generator=generator)
        loss = nn.functional.cross_entropy(model(pixel_values=x[index]).logits, y[index])
        loss.backward()
        start = ledger.totals(comm.INTER)
        runtime.sync_gradients()
        end = ledger.totals(comm.INTER)
        optimizer.step()
        optimizer.zero_grad()
        runtime.after_optimizer_step()
        sent.append(end.sent - start.sent)
        received.append(end.received - start.received)
    fp = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "rank": rank,
        "dense_fp32_allreduce": dense,
        "sent_per_step": statistics.mean(sent),
        "received_per_step": statistics.mean(received),
        "codes": runtime.layout.numel if runtime.layout is not None else 0,
        "fp_parameters": fp,
        "dense_parameters": dense_numel,
    }


def measure(workers: int, options: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    """Per-rank bytes per step (mean over ``steps``) of the exchange and of the dense baseline, on ``workers`` ranks.

    ``options``: the strategy's settings as in :func:`sparseflip_settings` (``{}``: the defaults).
    """
    ranks = run_distributed(_worker, workers, options, steps)
    server = sparseflip_settings(options).exchange.server
    worst_sent = max(r["sent_per_step"] for r in ranks)
    workers_only = [r for r in ranks if r["rank"] != server] or ranks
    dense_sent = max(r["dense_fp32_allreduce"]["sent"] for r in ranks)
    return {
        "workers": workers,
        "options": options,
        "codes": ranks[0]["codes"],
        "fp_parameters": ranks[0]["fp_parameters"],
        "dense_parameters": ranks[0]["dense_parameters"],
        "worker_sent_per_step": statistics.mean(r["sent_per_step"] for r in workers_only),
        "worker_received_per_step": statistics.mean(r["received_per_step"] for r in workers_only),
        "max_rank_sent_per_step": worst_sent,
        "server_received_per_step": next((r["received_per_step"] for r in ranks if r["rank"] == server), None),
        "dense_fp32_allreduce_sent_per_rank": dense_sent,
        "bytes_ratio_vs_dense": dense_sent / max(worst_sent, 1.0),
        "ranks": ranks,
    }


def _train_worker(rank: int, world: int, model_name: str, dataset: str, steps: int, options: dict[str, Any]):
    import math
    import time

    from lowbit_experiments import build_model, load_dataset

    from lightning_hetero.sparseflip.runtime import SparseFlipRuntime

    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_dataset(dataset, seed=0)
    torch.manual_seed(0)
    model = build_model(model_name, x_train.shape[-1])
    runtime = SparseFlipRuntime(sparseflip_settings({"skip": (), **options}))
    runtime.setup(model, torch.device("cpu"))
    runtime.total_steps = steps
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    order = torch.Generator().manual_seed(0)
    permutation, cursor, batch_size = torch.randperm(len(x_train), generator=order), 0, 64
    share = batch_size // world
    ledger = comm.get_ledger()
    start_bytes, flips = ledger.totals(comm.INTER), 0
    start = time.perf_counter()
    for step in range(steps):
        if cursor + batch_size > len(x_train):
            permutation, cursor = torch.randperm(len(x_train), generator=order), 0
        batch = permutation[cursor : cursor + batch_size][rank * share : (rank + 1) * share]
        cursor += batch_size
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
        runtime.sync_gradients()
        optimizer.step()
        flips += int(runtime.after_optimizer_step()["lowbit/flips"])
    seconds = time.perf_counter() - start
    end_bytes = ledger.totals(comm.INTER)
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(-1) == y_test).float().mean())
    return {
        "rank": rank,
        "accuracy": accuracy,
        "flips": flips,
        "seconds": seconds,
        "sent_per_step": (end_bytes.sent - start_bytes.sent) / steps,
        "received_per_step": (end_bytes.received - start_bytes.received) / steps,
        "codes": runtime.layout.numel if runtime.layout is not None else 0,
        "fp_parameters": sum(p.numel() for p in params),
        "dense_fp32_bytes": 4 * sum(p.numel() for p in build_model(model_name, x_train.shape[-1]).parameters()),
    }


def train_distributed(
    workers: int, model_name: str, dataset: str, steps: int, options: dict[str, Any]
) -> dict[str, Any]:
    """Flip-train on ``workers`` spawned ranks with the sparseflip runtime; accuracy (identical on every rank) and
    the largest per-rank bytes per step."""
    ranks = run_distributed(_train_worker, workers, model_name, dataset, steps, options, timeout=3600.0)
    assert len({r["accuracy"] for r in ranks}) == 1, "replicas diverged"
    worst = max(r["sent_per_step"] for r in ranks)
    dense = ranks[0]["dense_fp32_bytes"] * 2 * (workers - 1) / workers  # ring all-reduce bytes sent per rank
    return {
        "workers": workers,
        "model": model_name,
        "dataset": dataset,
        "steps": steps,
        "options": options,
        "accuracy": ranks[0]["accuracy"],
        "flips": ranks[0]["flips"],
        "seconds": max(r["seconds"] for r in ranks),
        "max_rank_sent_per_step": worst,
        "dense_fp32_allreduce_sent_per_rank": dense,
        "bytes_ratio_vs_dense": dense / max(worst, 1.0),
        "codes": ranks[0]["codes"],
        "fp_parameters": ranks[0]["fp_parameters"],
    }
