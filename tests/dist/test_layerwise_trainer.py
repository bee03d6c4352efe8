"""LayerwiseStrategy (DGL) on spawned CPU ranks (gloo): Trainer fit with validation, checkpoint and resume; Fabric.

Every fit spawns its own ranks (``start_method="spawn"``). Each rank writes what the assertions need to ``tmp_path``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from transformers import LlamaForCausalLM

from lightning_hetero.strategies.layerwise.fabric import LayerwiseStrategy as FabricLayerwiseStrategy
from lightning_hetero.strategies.layerwise.trainer import LayerwiseStrategy
from tests.fixtures import StrategyStepLlama, ValidatedTokenData, fit_ranks, pipeline_fields


def _data() -> ValidatedTokenData:
    """One batch of 4 sequences per epoch, the same every epoch (resume then depends only on the restored state)."""
    return ValidatedTokenData(4, batch_size=4)


def _fit(out: Path, max_steps: int, checkpoint: Path | None = None, ckpt_path: Path | None = None) -> list[dict]:
    """Validation once, at the last step."""
    return fit_ranks(
        out, StrategyStepLlama, _data(),
        LayerwiseStrategy(start_method="spawn"), max_steps, checkpoint, ckpt_path,
        recorder={"fields": pipeline_fields}, gradient_clip_val=1.0, limit_val_batches=1,
        check_val_every_n_epoch=max_steps, num_sanity_val_steps=0,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_fit_validates_and_resumes_bit_identically(tmp_path: Path) -> None:
    straight = _fit(tmp_path / "straight", 8)
    stage0, stage1 = straight
    assert (stage0["stage"], stage1["stage"]) == (0, 1)
    for record in straight:  # every stage's own local loss falls
        assert len(record["losses"]) == 8 and record["losses"][-1] < record["losses"][0] - 0.3, record["losses"]
    assert stage0["metrics"]["val/loss"] == stage1["metrics"]["val/loss"] < stage1["losses"][0]
    assert "model.stem.weight" in stage0["state"] and not any(".stem." in k for k in stage1["state"])  # embedding
    assert all(k.startswith("model.") for k in stage1["state"])  # the stage container took the model's place
    assert stage0["pipeline_bytes"] > 0

    checkpoint = tmp_path / "step4.ckpt"
    _fit(tmp_path / "first", 4, checkpoint=checkpoint)
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "meta.json", "stage_0.pt", "stage_0.pt.sha256", "stage_1.pt", "stage_1.pt.sha256",
    ]  # fmt: skip
    resumed = _fit(tmp_path / "resumed", 8, ckpt_path=checkpoint)
    for rank, (first, again) in enumerate(zip(straight, resumed, strict=True)):
        assert again["losses"] == first["losses"][4:], rank
        for name, value in first["state"].items():
            assert torch.equal(value, again["state"][name]), (rank, name)


def _fabric_train(fabric: Fabric, out: Path) -> None:
    strategy = fabric.strategy
    torch.manual_seed(0)
    model = fabric.setup_module(StrategyStepLlama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    batch = next(iter(_data().train_dataloader()))
    losses = []
    for _ in range(6):
        losses.append(float(strategy.train_step(batch)))
        optimizer.step()
        optimizer.zero_grad()
    val = float(strategy.eval_step(batch))
    fabric.save(out / "ckpt", {"model": model, "optimizer": optimizer})
    exported = strategy.export(out / "export")  # every rank calls it; rank 0 writes
    logits = strategy.runtime.predict(batch)
    record = {"stage": strategy.stage_index, "losses": losses, "val": val, "exported": exported, "logits": logits}
    record["model_loss"] = strategy.model_loss
    torch.save(record, out / f"rank{fabric.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fabric_trains_evaluates_and_saves(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricLayerwiseStrategy(start_method="spawn"))
    fabric.launch(_fabric_train, tmp_path)
    records = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    for record in records:
        assert record["losses"][-1] < record["losses"][0], record["losses"]
    assert records[0]["val"] == records[1]["val"]
    assert (tmp_path / "ckpt" / "meta.json").is_file() and (tmp_path / "ckpt" / "stage_1.pt").is_file()
    assert records[0]["model_loss"] == records[1]["model_loss"] == records[1]["losses"][-1]  # rank 0 knows it too
    # the export: one ordinary HF model, the tied embedding / LM head (two trained copies) written untied
    assert records[0]["exported"] == str(tmp_path / "export") and records[1]["exported"] is None
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert not exported.config.tie_word_embeddings
    with torch.no_grad():
        logits = exported(input_ids=next(iter(_data().train_dataloader()))["input_ids"]).logits
    torch.testing.assert_close(logits, records[1]["logits"], rtol=1e-5, atol=1e-5)
