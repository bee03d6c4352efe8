"""Modules and data written the way users write them, not the way our reference modules are.

Plain Lightning style: the HF model is an attribute, the loss is computed in ``training_step`` /
``validation_step`` by calling ``self.model(**batch)``, there is no ``forward(**batch)``, and the module defines its
own dataloaders (no DataModule). The user-code tests (``tests/usercode/``) run these through every strategy and
callback, so our code may not assume anything of them beyond what stock Lightning assumes. Importable from spawned
ranks as ``tests.usercode.usernets``.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from tests.token_data import VOCAB, progression_ids


class Progressions(Dataset):
    """Arithmetic progressions mod ``VOCAB``: learnable in a few steps. Items are HF-style dicts."""

    def __init__(self, count: int, length: int = 16, seed: int = 0) -> None:
        self.ids = progression_ids(count, length, seed)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.ids[index]
        return {"input_ids": row, "labels": row.clone()}


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A Llama small enough for CPU tests (hidden 32, 2 layers, FFN 64)."""
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


class UserLlama(L.LightningModule):
    """A user's causal-LM module: ``self.model(**batch).loss`` in the steps, its own dataloaders, AdamW."""

    def __init__(self, lr: float = 3e-3, batch_size: int = 8, train_items: int = 256, val_items: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(tiny_llama_config())

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            Progressions(self.hparams.train_items, seed=0), batch_size=self.hparams.batch_size, shuffle=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Progressions(self.hparams.val_items, seed=1), batch_size=self.hparams.batch_size)


class ClassDigits(Dataset):
    """8x8 one-channel 'digits' whose class is the quadrant with the bright blob, in class order (like MNIST files)."""

    def __init__(self, count: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(count) % 4
        self.labels, _ = torch.sort(self.labels)  # class-ordered on purpose: a fair evaluation must not rely on order
        images = 0.1 * torch.randn(count, 1, 8, 8, generator=generator)
        for index, label in enumerate(self.labels.tolist()):
            row, col = divmod(label, 2)
            images[index, 0, 4 * row : 4 * row + 4, 4 * col : 4 * col + 4] += 1.0
        self.images = images

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class UserCNN(L.LightningModule):
    """A user's small image classifier: ``(x, y)`` tuples, loss and accuracy in the steps, own dataloaders, SGD."""

    def __init__(self, lr: float = 0.05, batch_size: int = 16, train_items: int = 256, val_items: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 8 * 8, 32),
            nn.ReLU(),
            nn.Linear(32, 4),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == labels).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            ClassDigits(self.hparams.train_items, seed=0), batch_size=self.hparams.batch_size, shuffle=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(ClassDigits(self.hparams.val_items, seed=1), batch_size=self.hparams.batch_size)
