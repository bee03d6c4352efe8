"""VerifiedCheckpoint in a one-process Trainer: every N steps, newest two kept, each with a manifest; resume works."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero.callbacks import VerifiedCheckpoint
from lightning_hetero.reliability import (
    CorruptCheckpointError,
    UnverifiedCheckpointWarning,
    corrupt_file,
    latest_good_checkpoint,
    manifest_file,
    verify_checkpoint,
)


class Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(directory: Path, max_steps: int, ckpt_path: Path | None = None) -> tuple[Linear, VerifiedCheckpoint]:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    saver = VerifiedCheckpoint(dirpath=directory, every_n_train_steps=2)
    module = Linear()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver],
    )
    trainer.fit(module, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8), ckpt_path=ckpt_path)
    return module, saver


def test_every_n_steps_newest_two_kept_with_manifests(tmp_path):
    _, saver = _fit(tmp_path, max_steps=6)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "step=000004.ckpt",
        "step=000004.ckpt.manifest.json",
        "step=000006.ckpt",
        "step=000006.ckpt.manifest.json",
    ]
    assert [s["step"] for s in saver.saves] == [2, 4, 6] and all(s["bytes"] > 0 for s in saver.saves)
    assert verify_checkpoint(tmp_path / "step=000006.ckpt")["step"] == 6


def test_resume_from_latest_good_equals_the_uninterrupted_run(tmp_path):
    full, _ = _fit(tmp_path / "full", max_steps=6)
    _fit(tmp_path / "cut", max_steps=4)
    corrupt_file(tmp_path / "cut" / "step=000004.ckpt")  # the newest is damaged: fall back to step 2
    resume = latest_good_checkpoint(tmp_path / "cut")
    assert resume == tmp_path / "cut" / "step=000002.ckpt"
    resumed, _ = _fit(tmp_path / "cut", max_steps=6, ckpt_path=resume)
    for a, b in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert manifest_file(tmp_path / "cut" / "step=000006.ckpt").is_file()


def _flip_one_weight_bit(path: Path) -> None:
    """Flip the lowest bit of the stored ``layer.weight`` (a silent corruption: the file still loads)."""
    weight = torch.load(path, weights_only=True)["state_dict"]["layer.weight"]
    data = bytearray(path.read_bytes())
    offset = data.find(weight.numpy().tobytes())
    assert offset >= 0
    data[offset] ^= 1
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=True)["state_dict"]["layer.weight"], weight)


def test_a_flipped_bit_in_ckpt_path_stops_the_fit_before_the_first_step(tmp_path):
    """Stock strategy: the callback verifies the given ckpt_path (after Lightning loaded it, before training)."""
    _fit(tmp_path, max_steps=4)
    given = tmp_path / "step=000004.ckpt"
    _flip_one_weight_bit(given)
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        _fit(tmp_path, max_steps=6, ckpt_path=given)
    assert not (tmp_path / "step=000006.ckpt").exists()


def test_a_ckpt_path_without_manifest_resumes_with_a_warning(tmp_path):
    _fit(tmp_path, max_steps=4)
    given = tmp_path / "step=000004.ckpt"
    manifest_file(given).unlink()
    with pytest.warns(UnverifiedCheckpointWarning, match="no manifest"):
        _fit(tmp_path, max_steps=6, ckpt_path=given)
    assert verify_checkpoint(tmp_path / "step=000006.ckpt")["step"] == 6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_train_steps": 0}, "every_n_train_steps"),
        ({"every_n_train_steps": 2, "keep": 0}, "keep"),
        ({"every_n_train_steps": 2, "filename": "last"}, "filename"),
        ({"every_n_train_steps": 2, "monitor": "val/loss"}, "monitor"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        VerifiedCheckpoint(dirpath=tmp_path, **kwargs)
