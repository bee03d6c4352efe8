"""What the text DataModules share: a tokenizer made on first use, and tokenized splits cached on disk."""

from __future__ import annotations

import json
import logging
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerFast

from lightning_hetero.data.base import DatasetSplitsMixin, atomic_directory, content_key, quiet_datasets
from lightning_hetero.data.tokenization import TokenizerRecipe, load_pretrained_tokenizer, trained_tokenizer

log = logging.getLogger(__name__)


class TokenizedSplitsMixin(DatasetSplitsMixin):
    """Text DataModules whose tokenized train/validation splits are built once into a cache entry.

    ``prepare_data`` builds the entry (tokenizer included) if it is missing, and ``setup`` loads it, so later calls
    and runs hit the cache. The entry is ``<cache_root>/<tokenized_kind>/<content key of _tokenized_key()>`` with one
    saved ``datasets.Dataset`` per split and a ``stats.json``, written last (its presence marks a complete entry).

    Subclasses set :attr:`tokenizer_recipe`, :attr:`tokenized_kind`, ``cache_root``, ``tokenizer_path`` (None trains
    the recipe's tokenizer), ``tokenizer_vocab_size`` and a ``_split`` pair ``(train units, validation units)``, and
    implement :meth:`_tokenizer_texts`, :meth:`_tokenized_key`, :meth:`_stats_fields` and :meth:`_tokenize_split`;
    :meth:`_check_splits` may reject splits too small to train on.
    """

    #: How the tokenizer is trained when ``tokenizer_path`` is None.
    tokenizer_recipe: ClassVar[TokenizerRecipe]
    #: Cache subdirectory of the tokenized entries, e.g. ``"blocks"``.
    tokenized_kind: ClassVar[str]
    #: GGUF file inside ``tokenizer_path`` to read the pretrained tokenizer from (None: a tokenizer directory).
    tokenizer_gguf_file: str | None = None

    cache_root: Path
    tokenizer_path: str | None
    tokenizer_vocab_size: int
    _split: tuple[list[Any], list[Any]]

    def __init__(self) -> None:
        super().__init__()
        self._tokenizer: PreTrainedTokenizerFast | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The ``PreTrainedTokenizerFast`` (made and cached on first use, then loaded from the cache)."""
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model must embed: ``len(tokenizer)``, special tokens included."""
        return len(self.tokenizer)

    def _load_tokenizer(self) -> PreTrainedTokenizerFast:
        if self.tokenizer_path is not None:
            return load_pretrained_tokenizer(self.tokenizer_path, self.tokenizer_gguf_file, self.cache_root)
        return trained_tokenizer(
            self.tokenizer_recipe, self._tokenizer_texts(), self.tokenizer_vocab_size, self.cache_root
        )

    @cached_property
    def tokenized_dir(self) -> Path:
        """Cache entry of the tokenized splits, keyed by everything that shapes them (:meth:`_tokenized_key`)."""
        return self.cache_root / self.tokenized_kind / content_key(*self._tokenized_key())

    def _tokenizer_texts(self) -> list[str]:
        """Subclass hook: the training text the tokenizer is trained on (and keyed by)."""
        raise NotImplementedError

    def _tokenized_key(self) -> tuple[Any, ...]:
        """Subclass hook: the content-key parts of the tokenized splits (layout version, split content, tokenizer)."""
        raise NotImplementedError

    def _stats_fields(self) -> dict[str, Any]:
        """Subclass hook: the leading ``stats.json`` fields (the settings that shape the examples)."""
        raise NotImplementedError

    def _tokenize_split(self, units: list[Any], fingerprint: str) -> tuple[Any, dict[str, Any]]:
        """Subclass hook: the ``datasets.Dataset`` of one split's ``units`` and that split's sizes for ``stats.json``.

        ``fingerprint`` (unique per entry and split) names the ``datasets`` map cache of the split.
        """
        raise NotImplementedError

    def _check_splits(self) -> None:
        """Subclass hook: raise a clear error if the loaded splits cannot train (called at the end of ``setup``)."""

    def _build_tokenized(self, directory: Path) -> None:
        log.info("Tokenizing the %s splits (cache miss) -> %s", type(self).__name__, directory)
        stats = {**self._stats_fields(), "vocab_size": len(self.tokenizer)}
        with quiet_datasets(), atomic_directory(directory) as staging:
            for split, units in zip(("train", "validation"), self._split, strict=True):
                dataset, stats[split] = self._tokenize_split(units, f"{directory.name}-{split}")
                dataset.save_to_disk(str(staging / split))
            (staging / "stats.json").write_text(json.dumps(stats, indent=2))

    def _ensure_tokenized(self) -> Path:
        directory = self.tokenized_dir
        if not (directory / "stats.json").exists():
            self._build_tokenized(directory)
        return directory

    def prepare_data(self) -> None:
        """Make the tokenizer and tokenize the text once; later calls and runs hit the cache."""
        self._ensure_tokenized()

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenizer and the tokenized splits from the cache (building them if ``prepare_data`` did not)."""
        if self._datasets:
            return
        self._load_cached_splits(self._ensure_tokenized())
        self._check_splits()

    def _require_full_training_batch(self, examples: str, remedy: str) -> None:
        """Raise unless the training split fills at least one batch (``examples`` names its units)."""
        count = len(self._datasets["train"])
        if count < self.batch_size:
            raise ValueError(
                f"Only {count} training {examples}, fewer than `batch_size={self.batch_size}` (the last partial batch "
                f"is dropped). {remedy}"
            )
