"""What the text DataModules share: a tokenizer made on first use, and tokenized splits cached on disk."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from lightning_hetero.data.base import DatasetSplitsMixin


class TokenizedSplitsMixin(DatasetSplitsMixin):
    """Text DataModules whose tokenized train/validation splits are built once into a cache entry.

    ``prepare_data`` builds the entry (tokenizer included) if it is missing, and ``setup`` loads it, so later calls
    and runs hit the cache. Subclasses set ``self._tokenizer = None`` in ``__init__`` and implement
    :meth:`_load_tokenizer`, :meth:`_tokenized_dir` and :meth:`_build_tokenized`; :meth:`_check_splits` may reject
    splits too small to train on.
    """

    _tokenizer: PreTrainedTokenizerFast | None

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
        """Subclass hook: load the pretrained tokenizer, or train (or load the cached) one."""
        raise NotImplementedError

    def _tokenized_dir(self) -> Path:
        """Subclass hook: the cache entry of the tokenized splits (a content key of all that shapes them)."""
        raise NotImplementedError

    def _build_tokenized(self, directory: Path) -> None:
        """Subclass hook: tokenize both splits and publish them, with a ``stats.json``, as ``directory``."""
        raise NotImplementedError

    def _check_splits(self) -> None:
        """Subclass hook: raise a clear error if the loaded splits cannot train (called at the end of ``setup``)."""

    def _ensure_tokenized(self) -> Path:
        directory = self._tokenized_dir()
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
