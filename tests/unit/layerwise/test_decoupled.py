"""DGL building blocks on one process: the replay buffer's bounds, the batch ring, argument and split errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hetero.layerwise.decoupled import ActivationLink, batch_signature, header_bytes
from lightning_hetero.layerwise.dgl_runtime import DecoupledRuntime
from lightning_hetero.layerwise.dgl_stage import DGLStageModel, build_dgl_stage
from lightning_hetero.layerwise.replay import BatchRing, ReplayBuffer
from lightning_hetero.layerwise.settings import LayerwiseSettings
from lightning_hetero.pipeline.settings import PipelineSettings


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(6 * 8 * 8, 10),
    )  # fmt: skip


def _holder() -> nn.Module:
    holder = nn.Module()
    holder.model = _cnn()
    return holder


def test_replay_buffer_keeps_at_most_capacity_and_bounds_staleness() -> None:
    buffer = ReplayBuffer(3)
    for step in range(5):
        buffer.push(step, torch.full((1,), float(step)))
        assert len(buffer) <= 3
    assert buffer.steps == [2, 3, 4]
    assert buffer.dropped_unused == 2
    entry = buffer.newest_usable(4)
    assert entry is not None and entry.step == 4
    assert buffer.newest_usable(5).step == 4 and buffer.replays == 1  # reused: a replay
    assert buffer.newest_usable(7) is None  # 7 - 4 >= capacity: too stale
    assert buffer.newest_usable(3).step == 3  # never an entry produced after the step asking
    buffer.push(4, torch.zeros(1))  # the same batch again (a replaying predecessor): replaces the newest entry
    assert buffer.steps == [2, 3, 4] and float(buffer.newest_usable(4).activations) == 0.0
    with pytest.raises(ValueError, match="must not decrease"):
        buffer.push(3, torch.zeros(1))


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
def test_replay_capacity_must_be_a_positive_int(capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="LayerwiseSettings.replay_capacity"):
        LayerwiseSettings(replay_capacity=capacity)  # type: ignore[arg-type]


def test_batch_ring_forgets_old_steps() -> None:
    ring = BatchRing(2)
    for step in range(4):
        ring.add(step, {"step": step})
    assert len(ring) == 2 and ring.get(3) == {"step": 3}
    with pytest.raises(KeyError, match="step 1 is not kept"):
        ring.get(1)


def test_signature_and_header() -> None:
    a = {"input_ids": torch.zeros(4, 7, dtype=torch.long), "labels": torch.zeros(4, 7, dtype=torch.long)}
    b = {"input_ids": torch.ones(2, 7, dtype=torch.long), "labels": torch.ones(2, 7, dtype=torch.long)}
    assert batch_signature(a) == batch_signature(b)  # batch size does not matter
    assert batch_signature(a) != batch_signature({k: v[:, :5] for k, v in a.items()})
    assert header_bytes() == 64
    with pytest.raises(ValueError, match="coord_dtype"):
        ActivationLink(1, codec="fp8")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipeline": {"num_stages": 0}}, "num_stages"),
        ({"mode": "eventually"}, "mode"),
        ({"aux_head": "conv"}, "aux_head"),
        ({"pipeline": {"boundary_dtype": "fp8"}}, "boundary_dtype"),
        ({"pipeline": {"num_stages": 3}, "boundaries": [1]}, "num_stages - 1 = 2 boundaries"),
        ({"pipeline": {"data_parallel_size": 0}}, "data_parallel_size"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, match: str) -> None:
    kwargs = dict(kwargs)
    pipeline = kwargs.pop("pipeline", {})
    with pytest.raises(ValueError, match=match):  # the settings check themselves, before any runtime exists
        LayerwiseSettings(pipeline=PipelineSettings(**pipeline), **kwargs)


def test_world_size_is_checked_before_launch() -> None:
    from lightning_hetero.core import WorldLayout

    runtime = DecoupledRuntime(LayerwiseSettings(pipeline=PipelineSettings(data_parallel_size=2)))
    with pytest.raises(ValueError, match="needs 4"):
        runtime.resolve_launch(WorldLayout(1, 2))


def test_split_that_does_not_fit_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match="num_stages=3"):
        build_dgl_stage(_holder(), 3, 0, None, "linear", None, torch.device("cpu"))  # 2 conv stages only
    with pytest.raises(ValueError, match="boundaries"):
        build_dgl_stage(_holder(), 2, 0, [5], "linear", None, torch.device("cpu"))


def test_aux_head_that_does_not_match_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match="aux_outputs=7"):
        build_dgl_stage(_holder(), 2, 0, None, "linear", 7, torch.device("cpu"))
    with pytest.raises(ValueError, match="lm_head"):
        build_dgl_stage(_holder(), 2, 0, None, "lm_head", None, torch.device("cpu"))


def test_stage_replaces_the_model_and_keeps_only_its_parameters() -> None:
    holder = _holder()
    total = sum(p.numel() for p in holder.parameters())
    _, container = build_dgl_stage(holder, 2, 1, None, "linear", None, torch.device("cpu"))
    assert isinstance(holder.model, DGLStageModel) and holder.model is container
    assert container.stem is None  # stage 1 has no stem
    kept = sum(p.numel() for p in holder.parameters())
    assert 0 < kept < total
    assert all(p.device.type == "cpu" for p in holder.parameters())
    with pytest.raises(RuntimeError, match="stage 1 of a 2-stage"):
        holder.model(torch.zeros(1))
