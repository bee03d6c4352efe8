"""A user's own model file, written for plain Lightning: nothing here knows about lightning_hetero.

``tests/usercode/test_cli_user_module.py`` copies it as ``mynets.py`` into a fresh directory next to a YAML and runs
the CLI there. Loss in ``training_step``, own dataloaders, no DataModule, no ``forward(**batch)`` on the LLM.
"""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64


class Sequences(Dataset):
    """Arithmetic progressions mod VOCAB, as HF-style dicts: learnable in a few steps."""

    def __init__(self, count, length=16, seed=0):
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (count,), generator=generator)
        strides = torch.randint(1, 5, (count,), generator=generator)
        self.ids = (starts[:, None] + torch.arange(length)[None] * strides[:, None]) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


class LitLlama(L.LightningModule):
    def __init__(self, lr=3e-3, batch_size=8):
        super().__init__()
        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(Sequences(256), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Sequences(32, seed=1), batch_size=self.hparams.batch_size)


class Blobs(Dataset):
    """8x8 images whose class is the quadrant holding a bright blob."""

    def __init__(self, count, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (count,), generator=generator)
        self.images = 0.1 * torch.randn(count, 1, 8, 8, generator=generator)
        for index, label in enumerate(self.labels.tolist()):
            row, col = divmod(label, 2)
            self.images[index, 0, 4 * row : 4 * row + 4, 4 * col : 4 * col + 4] += 1.0

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


class LitCNN(L.LightningModule):
    def __init__(self, lr=0.05, batch_size=16):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 8 * 8, 32),
            nn.ReLU(),
            nn.Linear(32, 4),
        )

    def forward(self, images):
        return self.net(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.log("val_loss", nn.functional.cross_entropy(self(images), labels), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(Blobs(256), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Blobs(32, seed=1), batch_size=self.hparams.batch_size)
