"""The modules inside a real Trainer: datamodule overrides, logged metric names, checkpoint reload."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hetero.models import CausalLMModule, ImageClassifierModule, Seq2SeqModule

from .helpers import image_batch, seq2seq_batch, token_batch


class RandomBatchesDataModule(L.LightningDataModule):
    """Serves a few fixed random batches and announces the config values the model must match."""

    def __init__(self, make_batch: Any, overrides: dict[str, Any], num_batches: int = 2) -> None:
        super().__init__()
        self.batches = [make_batch() for _ in range(num_batches)]
        self.overrides = overrides

    def hf_config_overrides(self) -> dict[str, Any]:
        return dict(self.overrides)

    def _loader(self) -> DataLoader:
        # batch_size=None: the dataset items already are batches.
        return DataLoader(self.batches, batch_size=None)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()


CASES = {
    "causal_lm": (
        CausalLMModule,
        lambda: token_batch(vocab_size=300),
        {"vocab_size": 300, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        {"perplexity"},
    ),
    "seq2seq": (
        Seq2SeqModule,
        lambda: seq2seq_batch(vocab_size=300),
        {"vocab_size": 300, "pad_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 0},
        {"perplexity", "token_accuracy"},
    ),
    "image_classifier": (
        ImageClassifierModule,
        lambda: image_batch(size=8, num_labels=3),
        {"image_size": 8, "num_channels": 1, "num_labels": 3},
        {"accuracy"},
    ),
}


def _trainer(tmp_path: Path) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_fit_validate_test_and_reload_checkpoint(case: str, tmp_path: Path) -> None:
    module_class, make_batch, overrides, metric_names = CASES[case]
    datamodule = RandomBatchesDataModule(make_batch, overrides)
    module = module_class(warmup_steps=1)
    trainer = _trainer(tmp_path)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 2
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    for key, value in overrides.items():
        assert getattr(module.model.config, key) == value

    validated = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    assert set(validated) == {"val/loss"} | {f"val/{name}" for name in metric_names}
    assert trainer.validate(module, datamodule=datamodule, verbose=False)[0] == validated  # no state carried over
    if "perplexity" in metric_names:  # one batch: the token-weighted perplexity is exp(mean token loss)
        assert validated["val/perplexity"] == pytest.approx(math.exp(validated["val/loss"]), rel=1e-4)
    tested = trainer.test(module, datamodule=datamodule, verbose=False)[0]
    assert set(tested) == {"test/loss"} | {f"test/{name}" for name in metric_names}

    # No datamodule at reload: the recorded overrides rebuild the same shapes, and the weights load strictly.
    checkpoint = tmp_path / "model.ckpt"
    trainer.save_checkpoint(checkpoint)
    reloaded = module_class.load_from_checkpoint(checkpoint)
    batch = datamodule.batches[0]
    module.eval()
    reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, module(**batch).logits)
