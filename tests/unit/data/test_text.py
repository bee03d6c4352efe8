"""TokenizedSplitsMixin and the trained-tokenizer cache: the pieces both text DataModules share."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import lightning as L
from tokenizers import Tokenizer

from lightning_hetero.data.base import content_key, hash_texts
from lightning_hetero.data.text import TokenizedSplitsMixin
from lightning_hetero.data.tokenization import (
    BPE_ALGORITHM_VERSION,
    TokenizerRecipe,
    tokenizer_fingerprint,
    train_byte_level_bpe,
    trained_tokenizer,
)

TEXTS = ["to be or not to be", "that is the question", "whether tis nobler in the mind to suffer"] * 4
trainings: list[int] = []


def _train_counted(texts: list[str], vocab_size: int) -> Tokenizer:
    trainings.append(vocab_size)
    return train_byte_level_bpe(texts, vocab_size, ["<eos>"])


RECIPE = TokenizerRecipe("bpe", BPE_ALGORITHM_VERSION, _train_counted, {"eos_token": "<eos>"})


def test_trained_tokenizer_is_cached_under_a_key_of_version_texts_and_vocab_size(tmp_path: Path):
    trainings.clear()
    first = trained_tokenizer(RECIPE, TEXTS, 300, tmp_path)
    second = trained_tokenizer(RECIPE, TEXTS, 300, tmp_path)
    key = content_key(BPE_ALGORITHM_VERSION, hash_texts(TEXTS), 300)
    assert (tmp_path / "tokenizers" / f"bpe-{key}" / "tokenizer.json").is_file()
    assert trainings == [300], "the second call must load the cache entry, not train again"
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second)
    assert first.eos_token == "<eos>" and len(first) <= 300
    trained_tokenizer(RECIPE, TEXTS, 280, tmp_path)
    assert trainings == [300, 280] and len(list((tmp_path / "tokenizers").iterdir())) == 2


class _Lines(TokenizedSplitsMixin, L.LightningDataModule):
    """The smallest text DataModule: one example per line, split by position."""

    tokenizer_recipe = RECIPE
    tokenized_kind = "lines"

    def __init__(self, cache_root: Path) -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.seed = 2, 0, 0
        self.cache_root = cache_root
        self.tokenizer_path = None
        self.tokenizer_vocab_size = 300

    @cached_property
    def _split(self) -> tuple[list[str], list[str]]:
        return TEXTS[:9], TEXTS[9:]

    def _tokenizer_texts(self) -> list[str]:
        return self._split[0]

    def _tokenized_key(self) -> tuple[Any, ...]:
        return ("lines-v1", hash_texts(TEXTS), tokenizer_fingerprint(self.tokenizer))

    def _stats_fields(self) -> dict[str, Any]:
        return {"kind": "lines"}

    def _tokenize_split(self, units: list[str], fingerprint: str) -> tuple[Any, dict[str, Any]]:
        from datasets import Dataset

        ids = self.tokenizer(units, add_special_tokens=False)["input_ids"]
        return Dataset.from_dict({"input_ids": ids}), {"lines": len(units), "fingerprint": fingerprint}


def test_mixin_publishes_both_splits_with_stats_that_setup_loads(tmp_path: Path):
    trainings.clear()
    datamodule = _Lines(tmp_path)
    assert datamodule._tokenizer is None and datamodule._datasets == {} and datamodule._stats == {}
    datamodule.prepare_data()
    directory = datamodule.tokenized_dir
    assert directory == tmp_path / "lines" / content_key(*datamodule._tokenized_key())
    assert sorted(p.name for p in directory.iterdir()) == ["stats.json", "train", "validation"]
    again = _Lines(tmp_path)
    again.setup("fit")
    assert trainings == [300], "setup must load the cached tokenizer and splits"
    assert [len(again.train_dataset), len(again.val_dataset)] == [9, 3]
    assert again._stats == {
        "kind": "lines",
        "vocab_size": len(again.tokenizer),
        "train": {"lines": 9, "fingerprint": f"{directory.name}-train"},
        "validation": {"lines": 3, "fingerprint": f"{directory.name}-validation"},
    }
    assert again.tokenizer.decode(again.val_dataset[0]["input_ids"]) == TEXTS[9]
