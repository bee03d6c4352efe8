"""ThroughputProgressBar: exact token counts, tok/s, s/step and an ETA to max_steps from the first step on."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hetero.callbacks import ThroughputProgressBar
from lightning_hetero.callbacks.progress import format_eta, tokens_in


class _TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _rows(count: int, length: int = 6, padded: int = 0) -> list[dict[str, torch.Tensor]]:
    mask = torch.ones(length, dtype=torch.long)
    mask[length - padded :] = 0
    ids = torch.arange(length) % 16
    return [{"input_ids": ids, "labels": ids, "attention_mask": mask} for _ in range(count)]


class _Seen(L.Callback):
    """What the bar shows after each training batch."""

    def __init__(self, bar: ThroughputProgressBar) -> None:
        self.bar, self.shown = bar, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.shown.append((trainer.global_step, self.bar.units, self.bar.throughput(trainer)))


def _fit(bar: ThroughputProgressBar, **kwargs) -> _Seen:
    seen = _Seen(bar)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[bar, seen],
        **kwargs,
    )
    trainer.fit(_TinyLM(), DataLoader(_rows(32, padded=2), batch_size=4))
    return seen


def test_tokens_are_counted_exactly_and_shown_from_the_first_step():
    bar = ThroughputProgressBar()
    seen = _fit(bar)
    assert [units for _, units, _ in seen.shown] == [16, 32, 48]  # 4 rows x 4 unpadded tokens per batch
    for step, _, shown in seen.shown:
        assert set(shown) == {"tok/s", "s/step", "eta"}, (step, shown)
        assert float(shown["tok/s"].replace(",", "")) > 0 and float(shown["s/step"]) > 0
    assert seen.shown[-1][2]["eta"] == "0:00:00"  # max_steps reached


def test_gradient_accumulation_counts_every_micro_batch_and_shows_after_the_first_optimizer_step():
    bar = ThroughputProgressBar()
    seen = _fit(bar, accumulate_grad_batches=2)
    assert [units for _, units, _ in seen.shown][:2] == [16, 32]
    assert seen.shown[0][2] == {}  # the first micro-batch did not finish an optimizer step yet
    assert set(seen.shown[1][2]) == {"tok/s", "s/step", "eta"}


def test_batches_without_token_ids_count_samples():
    assert tokens_in({"pixels": torch.zeros(2, 3)}) is None
    assert tokens_in({"input_ids": torch.zeros(2, 5, dtype=torch.long)}) == 10
    assert tokens_in(_rows(1, padded=1)[0]) == 5
    assert tokens_in((torch.zeros(2), torch.zeros(2))) is None


@pytest.mark.parametrize(("seconds", "text"), [(0, "0:00:00"), (59.6, "0:01:00"), (3725, "1:02:05")])
def test_eta_format(seconds, text):
    assert format_eta(seconds) == text
    assert format_eta(float("inf")) == "?"


def test_a_bad_token_key_is_refused():
    with pytest.raises(ValueError, match="token_key"):
        ThroughputProgressBar(token_key="")
