"""The framework-free pieces every strategy shares: the runtime base, clipping, checkpoint parts, JSON gather."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hetero.core import (
    StrategyRuntime,
    WorldLayout,
    all_gather_json,
    clip_grad_norm_over_group,
    load_part,
    part_file,
    remove_checkpoint,
    write_part,
)


class _Runtime(StrategyRuntime):
    def __init__(self, alpha: int = 1, beta: str = "b", owner: str = "X") -> None:
        self.alpha, self.beta, self.owner = alpha, beta, owner


def test_world_layout_and_base_defaults():
    assert WorldLayout(num_nodes=3, ranks_per_node=4).world_size == 12
    runtime = _Runtime()
    assert runtime.extra_checkpoint_state(torch.device("cpu")) is None
    assert not runtime.directory_checkpoint
    with pytest.raises(NotImplementedError):
        runtime.resolve_launch(WorldLayout(1, 1))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clipping_alone_equals_torch(norm_type):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 4
    reference = [p.grad.clone() for p in params]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, g in zip(ref_params, reference, strict=True):
        p.grad = g
    expected = torch.nn.utils.clip_grad_norm_(ref_params, 0.5, norm_type)
    norm = clip_grad_norm_over_group([p.grad for p in params], 0.5, norm_type, None, "intra", reduce=False)
    assert torch.allclose(norm, expected)
    for p, r in zip(params, ref_params, strict=True):
        assert torch.allclose(p.grad, r.grad)


def test_clipping_raises_on_non_finite_norm_naming_the_owner():
    grad = torch.tensor([float("nan"), 1.0])
    with pytest.raises(RuntimeError, match="MyStrategy: the gradient norm"):
        clip_grad_norm_over_group(
            [grad], 1.0, 2.0, None, "intra", error_if_nonfinite=True, reduce=False, owner="MyStrategy"
        )


def test_parts_are_written_atomically_and_missing_parts_are_named(tmp_path):
    state = {"weights": torch.arange(4.0), "step": 7}
    target = write_part(tmp_path / "ckpt", "rank_00000", state)
    assert target == part_file(tmp_path / "ckpt", "rank_00000") and target.is_file()
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["rank_00000.pt", "rank_00000.pt.sha256"]  # no temporary left
    loaded = load_part(tmp_path / "ckpt", "rank_00000")
    assert loaded["step"] == 7 and torch.equal(loaded["weights"], state["weights"])
    with pytest.raises(FileNotFoundError, match="rank_00001.pt is missing"):
        load_part(tmp_path / "ckpt", "rank_00001")
    remove_checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_json_gather_alone_round_trips():
    payload = {"error": None, "schema": {"layers": [1, 2]}}
    assert all_gather_json(payload, 1, torch.device("cpu")) == [payload]


class _Exploit:
    """Unpickling this would run ``marker.touch()``: what a crafted checkpoint does with weights_only=False."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_checkpoint_part_carrying_a_malicious_pickle_is_refused(tmp_path):
    import pickle

    marker = tmp_path / "owned"
    directory = tmp_path / "ckpt"
    directory.mkdir()
    torch.save({"state_dict": {}, "payload": _Exploit(str(marker))}, part_file(directory, "rank_00000"))
    with pytest.raises(pickle.UnpicklingError):
        load_part(directory, "rank_00000")
    assert not marker.exists()  # nothing of it ran


@pytest.mark.parametrize("damage", ["flip_a_byte", "truncate"])
def test_a_corrupted_or_truncated_part_is_detected_naming_the_file(tmp_path, damage):
    from lightning_hetero.core import CorruptCheckpointError

    target = write_part(tmp_path, "stage_1", {"w": torch.arange(100.0)})
    raw = bytearray(target.read_bytes())
    if damage == "flip_a_byte":
        raw[len(raw) // 2] ^= 0xFF
    else:
        raw = raw[: len(raw) // 2]
    target.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="stage_1.pt does not match its checksum"):
        load_part(tmp_path, "stage_1")


def test_a_part_without_checksum_still_loads(tmp_path):
    target = write_part(tmp_path, "old", {"w": torch.ones(2)})
    (tmp_path / "old.pt.sha256").unlink()  # written before checksums existed
    assert torch.equal(load_part(tmp_path, "old")["w"], torch.ones(2))
    assert target.is_file()
