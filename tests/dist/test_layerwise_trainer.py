"""LayerwiseStrategy (DGL) on spawned CPU ranks (gloo): Trainer fit with validation, checkpoint and resume; Fabric.

Every fit spawns its own ranks (``start_method="spawn"``). Each rank writes what the assertions need to ``tmp_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero import comm
from lightning_hetero.strategies.layerwise.fabric import LayerwiseStrategy as FabricLayerwiseStrategy
from lightning_hetero.strategies.layerwise.trainer import LayerwiseStrategy
from tests.token_data import VOCAB, progressions

SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
SMALL_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}


class TokenData(L.LightningDataModule):
    """One batch of 4 sequences per epoch, the same every epoch."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(progressions(4), batch_size=4, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(progressions(4), batch_size=4, shuffle=False)


class TinyLlamaModule(L.LightningModule):
    """A user's LightningModule holding an HF Llama with tied embeddings (the strategy unties them per stage)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**SMALL, **SMALL_HEADS, tie_word_embeddings=True))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        raise AssertionError("the strategy runs the stage's step; the module's training_step is not called")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        raise AssertionError("defined only to switch validation on; the strategy runs it")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class Recorder(Callback):
    def __init__(self, out: Path, checkpoint: Path | None = None) -> None:
        self.out, self.checkpoint, self.losses = out, checkpoint, []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.checkpoint is not None and trainer.global_step == 4:
            trainer.save_checkpoint(self.checkpoint)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {
            "stage": trainer.strategy.stage_index,
            "losses": self.losses,
            "state": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict(),
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "pipeline_bytes": comm.get_ledger().totals(comm.PIPELINE).sent,
        }
        torch.save(record, self.out / f"rank{trainer.global_rank}.pt")


def _fit(out: Path, max_steps: int, checkpoint: Path | None = None, ckpt_path: Path | None = None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=LayerwiseStrategy(num_stages=2, start_method="spawn"),
        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Recorder(out, checkpoint)], gradient_clip_val=1.0,
        limit_val_batches=1, check_val_every_n_epoch=max_steps, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(TinyLlamaModule(), TokenData(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


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
    model = fabric.setup_module(TinyLlamaModule())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    batch = next(iter(TokenData().train_dataloader()))
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
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricLayerwiseStrategy(num_stages=2, start_method="spawn"))
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
        logits = exported(input_ids=next(iter(TokenData().train_dataloader()))["input_ids"]).logits
    torch.testing.assert_close(logits, records[1]["logits"], rtol=1e-5, atol=1e-5)
