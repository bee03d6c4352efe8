"""The FlexDeMo re-cut on one process: parts of a 2 x 2 run (written by hand) rebuilt for other layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_hetero.core import CorruptCheckpointError, write_part
from lightning_hetero.flexdemo.reshard import (
    SavedLayout,
    TargetLayout,
    combine_replicas,
    consolidate_pieces,
    cut_shard,
    load_resharded_part,
)

SAVED = SavedLayout(world_size=4, shard_size=2)  # 2 replicas x 2 shards


def _rows(full: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
    chunk = -(-full.shape[0] // shards)
    return full[shard * chunk : (shard + 1) * chunk]


def _write_saved_run(directory: Path, trainer: bool = False) -> dict[str, torch.Tensor]:
    """Parts of a 2 x 2 run of ``nn.Linear(3, 5)``: weight/bias sharded by rows, per-replica error feedback.

    ``trainer``: the Lightning Trainer's layout (``state_dict``, ``optimizer_states`` list) instead of Fabric's.
    """
    torch.manual_seed(0)
    full = {"weight": torch.randn(5, 3), "bias": torch.randn(5)}
    errors = [{"weight": torch.randn(5, 3), "bias": torch.randn(5)} for _ in range(2)]  # per replica
    moments = {"weight": torch.rand(5, 3), "bias": torch.rand(5)}  # identical on both replicas
    for rank in range(SAVED.world_size):
        replica, shard = divmod(rank, SAVED.shard_size)
        state = {
            index: {
                "step": torch.tensor(3.0),
                "error": _rows(errors[replica][name], shard, 2).clone(),
                "exp_avg": _rows(moments[name], shard, 2).clone(),
            }
            for index, name in enumerate(("weight", "bias"))
        }
        anchors = {index: _rows(full[name], shard, 2).clone() for index, name in enumerate(("weight", "bias"))}
        part = {
            "model": {name: _rows(value, shard, 2).clone() for name, value in full.items()},
            "optimizer": {
                "state": state,
                "param_groups": [{"lr": 0.1, "params": [0, 1]}],
                "replicator": {"name": "diloco", "step": 3, "anchors": anchors},
            },
            "step": 3,
            "rank_written": rank,
        }
        if trainer:
            part = {"state_dict": part.pop("model"), "optimizer_states": [part.pop("optimizer")], **part}
        write_part(directory, f"rank_{rank:05d}", part)
    return {
        **{f"full.{k}": v for k, v in full.items()},
        **{f"error{r}.{k}": v for r in range(2) for k, v in errors[r].items()},
        **{f"moment.{k}": v for k, v in moments.items()},
    }


def _load(directory: Path, target: TargetLayout, module: nn.Module) -> dict:
    shapes = {"weight": [5, 3], "bias": [5]}
    names = [f"rank_{rank:05d}" for rank in range(SAVED.world_size)]
    return load_resharded_part(directory, names, SAVED, target, shapes, module, list(module.parameters()))


def test_one_unsharded_replica_gets_full_tensors_and_the_replica_mean(tmp_path):
    saved = _write_saved_run(tmp_path)
    part = _load(tmp_path, TargetLayout(num_replicas=1, replica=0, shard_size=1, shard_index=0), nn.Linear(3, 5))
    assert part["step"] == 3 and part["rank_written"] == 0  # everything else from saved rank 0
    for index, name in enumerate(("weight", "bias")):
        assert torch.equal(part["model"][name], saved[f"full.{name}"])
        entry = part["optimizer"]["state"][index]
        mean = ((saved[f"error0.{name}"].double() + saved[f"error1.{name}"].double()) / 2).float()
        assert torch.equal(entry["error"], mean)
        assert torch.equal(entry["exp_avg"], saved[f"moment.{name}"])  # identical replicas: taken bit for bit
        assert torch.equal(entry["step"], torch.tensor(3.0))
        assert torch.equal(part["optimizer"]["replicator"]["anchors"][index], saved[f"full.{name}"])
    assert part["optimizer"]["replicator"]["step"] == 3


def test_same_replica_count_keeps_each_replica(tmp_path):
    saved = _write_saved_run(tmp_path)
    for replica in range(2):
        target = TargetLayout(num_replicas=2, replica=replica, shard_size=1, shard_index=0)
        part = _load(tmp_path, target, nn.Linear(3, 5))
        assert torch.equal(part["optimizer"]["state"][0]["error"], saved[f"error{replica}.weight"])


def test_pieces_are_concatenated_or_taken_when_replicated():
    full = torch.arange(10.0).reshape(5, 2)
    assert torch.equal(consolidate_pieces([full[:3], full[3:]], (5, 2), "w"), full)
    assert consolidate_pieces([full, full], (5, 2), "w") is full
    assert torch.equal(consolidate_pieces([full[:1], full[1:], full[:0]], (5, 2), "w"), full)
    with pytest.raises(ValueError, match=r"w: the saved shards .* assemble to \(4, 2\)"):
        consolidate_pieces([full[:2], full[3:]], (5, 2), "w")


def test_cut_follows_fsdp_chunks_and_checks_the_live_shape():
    full = torch.arange(5.0)
    target = TargetLayout(num_replicas=1, replica=0, shard_size=3, shard_index=2)
    assert torch.equal(cut_shard(full, torch.empty(1), True, target, "b"), torch.tensor([4.0]))
    with pytest.raises(ValueError, match="b: re-cut to"):
        cut_shard(full, torch.empty(2), True, target, "b")


def test_combine_mean_and_identity():
    one = TargetLayout(num_replicas=3, replica=2, shard_size=1, shard_index=0)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 2.0])
    assert torch.equal(combine_replicas([a, b], one), torch.tensor([2.0, 2.0]))
    assert combine_replicas([a, a.clone()], one) is a
    assert combine_replicas([a, b], TargetLayout(2, 1, 1, 0)) is b


def test_another_model_is_refused_naming_the_entry(tmp_path):
    _write_saved_run(tmp_path)
    with pytest.raises(ValueError, match="weight"):
        _load(tmp_path, TargetLayout(1, 0, 1, 0), nn.Linear(4, 5))


def test_a_damaged_saved_part_is_refused(tmp_path):
    _write_saved_run(tmp_path)
    path = tmp_path / "rank_00003.pt"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpointError, match="rank_00003"):
        _load(tmp_path, TargetLayout(1, 0, 1, 0), nn.Linear(3, 5))


def test_trainer_checkpoint_layout_is_re_cut_too(tmp_path):
    saved = _write_saved_run(tmp_path, trainer=True)
    module = nn.Linear(3, 5)
    shapes = {"weight": [5, 3], "bias": [5]}
    names = [f"rank_{rank:05d}" for rank in range(SAVED.world_size)]
    part = load_resharded_part(tmp_path, names, SAVED, TargetLayout(1, 0, 1, 0), shapes, module, [*module.parameters()])
    assert torch.equal(part["state_dict"]["weight"], saved["full.weight"])
    mean = ((saved["error0.bias"].double() + saved["error1.bias"].double()) / 2).float()
    assert torch.equal(part["optimizer_states"][0]["state"][1]["error"], mean)
    assert torch.equal(part["optimizer_states"][0]["state"][1]["exp_avg"], saved["moment.bias"])


def test_without_a_live_optimizer_the_model_is_re_cut_and_the_optimizer_state_passed_through(tmp_path):
    saved = _write_saved_run(tmp_path)
    shapes = {"weight": [5, 3], "bias": [5]}
    names = [f"rank_{rank:05d}" for rank in range(SAVED.world_size)]
    part = load_resharded_part(tmp_path, names, SAVED, TargetLayout(1, 0, 1, 0), shapes, nn.Linear(3, 5), [])
    assert torch.equal(part["model"]["weight"], saved["full.weight"])
    assert part["optimizer"]["state"][0]["error"].shape == (3, 3)  # saved rank 0's shard, untouched (validate/test)
