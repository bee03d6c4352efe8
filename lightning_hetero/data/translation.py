"""Seq2seq DataModule over English -> German/French message pairs from the gettext catalogs on the machine.

Every Debian/Ubuntu image carries compiled translation catalogs (``/usr/share/locale/<lang>/LC_MESSAGES/*.mo``) of
the programs installed on it: software messages with their human translations, e.g. ``"Floating point exception"
-> "Gleitkommafehler"``. Which catalogs exist depends on the image, so the pair count does too (about 19k en-de and
22k en-fr on the reference image); fewer than :data:`MIN_PAIRS` is an error.

Pipeline: catalogs -> cleaned, deduplicated pairs -> seeded split by pair -> shared Unigram tokenizer trained on both
sides of the training pairs (cached) -> tokenized ``datasets.Dataset`` saved to disk -> T5-style batches padded per
batch by :class:`Seq2SeqCollator`.
"""

from __future__ import annotations

import gettext
import logging
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.nn.utils.rnn import pad_sequence
from typing_extensions import override

from lightning_hetero.data.base import (
    check_fraction,
    check_optional_positive_int,
    check_positive_int,
    hash_texts,
    resolve_cache_root,
    seeded_permutation,
)
from lightning_hetero.data.text import TokenizedSplitsMixin
from lightning_hetero.data.tokenization import (
    UNIGRAM_ALGORITHM_VERSION,
    TokenizerRecipe,
    tokenizer_fingerprint,
    tokenizer_special_ids,
    train_unigram,
    validate_pretrained_tokenizer_args,
)

log = logging.getLogger(__name__)

#: Fewer usable pairs than this means the image lacks catalogs; a model would learn nothing useful.
MIN_PAIRS = 1000
#: Messages with fewer English words are mostly UI labels ("Open", "Save As") with little to translate.
MIN_SOURCE_WORDS = 3
#: Special tokens of the trained tokenizer, with the T5 ids: pad 0 (also the decoder start), eos 1, unk 2.
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
#: Bump when the tokenized layout changes (part of the dataset cache key; cleaning changes the key by itself).
PAIRS_VERSION = "t5-pairs-v1"

_FORMAT_PLACEHOLDER = re.compile(r"%|\{[^}]*\}")  # printf (%s, %1$d) and Python/brace ({}, {name}) formats
_LABEL_PREFIX = re.compile(r"^\|[^|]+\|")  # gnupg's "|pinentry-label|_Save ..." context prefix
_MNEMONIC = re.compile(r"(?<![\w`'\"])[_&](?=[^\W_])")  # GTK "_Save" / Qt "&Save" keyboard accelerators


def available_languages(locale_dir: str | Path) -> list[str]:
    """Languages with at least one non-ISO-table catalog under ``locale_dir`` (English variants excluded)."""
    root = Path(locale_dir)
    if not root.is_dir():
        return []
    return sorted(
        entry.name
        for entry in root.iterdir()
        if not (entry.name == "en" or entry.name.startswith(("en_", "en@"))) and catalog_files(root, entry.name)
    )


def catalog_files(locale_dir: str | Path, lang: str) -> list[Path]:
    """The ``.mo`` catalogs of ``lang``, sorted, without the ``iso_*`` tables (country and language names)."""
    messages = Path(locale_dir) / lang / "LC_MESSAGES"
    if not messages.is_dir():
        return []
    return sorted(p for p in messages.glob("*.mo") if not p.name.startswith("iso_"))


def read_catalog(path: Path) -> dict[Any, str]:
    """Raw ``msgid -> msgstr`` mapping of one catalog; an unreadable catalog (bad charset header) is skipped."""
    try:
        with path.open("rb") as handle:
            return gettext.GNUTranslations(handle)._catalog  # type: ignore[attr-defined]
    except (OSError, UnicodeDecodeError) as error:
        log.warning("Skipping unreadable gettext catalog %s: %s", path, error)
        return {}


def _strip_mnemonic(source: str, target: str) -> tuple[str, str]:
    """Drop a keyboard accelerator marker present once on each side ("Save _As" / "Speichern _unter").

    An identifier such as ``_gp`` also starts with ``_`` but is copied verbatim into the translation; requiring that
    the marked source word does not occur in the target keeps it.
    """
    for marker in "_&":
        if source.count(marker) != 1 or target.count(marker) != 1:
            continue
        match = _MNEMONIC.search(source)
        if match is not None and match.group(0) == marker:
            marked_word = marker + re.match(r"\w+", source[match.end() :]).group(0)  # type: ignore[union-attr]
            if marked_word not in target:
                return source.replace(marker, ""), target.replace(marker, "")
    return source, target


def clean_pair(msgid: Any, msgstr: str) -> tuple[str, str] | None:
    """One cleaned ``(english, translation)`` pair, or None when the entry is not a usable sentence pair.

    Drops plural entries (tuple keys), the metadata entry (empty msgid), untranslated entries, multi-line help
    texts (their line structure does not align), anything with a format placeholder, and sources under
    :data:`MIN_SOURCE_WORDS` words. Strips message contexts and accelerator markers and collapses whitespace.
    """
    if not isinstance(msgid, str) or not msgid or not msgstr:
        return None
    msgid = msgid.rsplit("\x04", 1)[-1]  # "context\x04message" when the entry has a msgctxt
    if "\n" in msgid.strip() or "\n" in msgstr.strip():
        return None
    if _FORMAT_PLACEHOLDER.search(msgid) or _FORMAT_PLACEHOLDER.search(msgstr):
        return None
    source, target = _strip_mnemonic(_LABEL_PREFIX.sub("", msgid), msgstr)
    source, target = " ".join(source.split()), " ".join(target.split())
    if len(source.split()) < MIN_SOURCE_WORDS or not target or source == target:
        return None
    return source, target


def extract_pairs(locale_dir: str | Path, lang: str) -> list[tuple[str, str]]:
    """Cleaned, deduplicated (by English text, first catalog wins) pairs from all catalogs of ``lang``."""
    pairs: dict[str, str] = {}
    for path in catalog_files(locale_dir, lang):
        catalog = read_catalog(path)
        for msgid in sorted(catalog, key=repr):  # explicit order: the result must not depend on dict internals
            cleaned = clean_pair(msgid, catalog[msgid])
            if cleaned is not None:
                pairs.setdefault(*cleaned)
    return list(pairs.items())


@dataclass
class Seq2SeqCollator:
    """Pad a batch to its longest member: ``input_ids`` with ``pad_token_id``, ``labels`` with -100 (ignored)."""

    pad_token_id: int
    label_pad_id: int = -100

    def __call__(self, examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        inputs = [example["input_ids"] for example in examples]
        input_ids = pad_sequence(inputs, batch_first=True, padding_value=self.pad_token_id)
        attention_mask = pad_sequence([torch.ones_like(ids) for ids in inputs], batch_first=True, padding_value=0)
        labels = pad_sequence(
            [example["labels"] for example in examples], batch_first=True, padding_value=self.label_pad_id
        )
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class TranslationDataModule(TokenizedSplitsMixin, L.LightningDataModule):
    """English -> ``target_lang`` translation of software messages, fully offline, for T5-style models.

    Batches are ``{"input_ids": Long[B,S], "attention_mask": Long[B,S], "labels": Long[B,T]}``, padded per batch;
    both sides end with ``</s>`` and padded label positions are -100. Use ``decoder_start_token_id = pad_token_id``.

    Split rule: by pair. The deduplicated pairs are permuted with ``seed``; the first ``max_pairs`` (all by default)
    are used and the first ``val_fraction`` of those go to validation. No English string is in both splits.

    Args:
        target_lang: Target language code, a directory under ``locale_dir`` (e.g. ``"de"``, ``"fr"``, ``"es"``).
        locale_dir: Root of the gettext catalogs.
        max_source_len: Source tokens kept per example (``</s>`` included; longer messages are truncated).
        max_target_len: Target tokens kept per example (``</s>`` included).
        batch_size: Pairs per batch (per process).
        val_fraction: Share of the pairs held out for validation.
        seed: Seeds the split and the training shuffle order.
        vocab_size: Size of the shared Unigram tokenizer trained when ``tokenizer`` is None.
        max_pairs: Use only this many pairs (a seeded random subset), e.g. for fast tests.
        tokenizer: Local directory or ``pkg://`` path of a pretrained tokenizer instead of training one; it must
            define an eos token (pad falls back to eos).
        num_workers: DataLoader worker processes.
        cache_dir: Cache root for the tokenizer and the tokenized pairs. None uses
            ``$LIGHTNING_HETERO_CACHE/data/translation`` (default ``~/.cache/lightning_hetero/data/translation``).
    """

    tokenizer_recipe = TokenizerRecipe(
        "unigram",
        UNIGRAM_ALGORITHM_VERSION,
        lambda texts, vocab_size: train_unigram(texts, vocab_size, pad=PAD, eos=EOS, unk=UNK),
        {"pad_token": PAD, "eos_token": EOS, "unk_token": UNK},
    )
    tokenized_kind = "pairs"

    def __init__(
        self,
        target_lang: str = "de",
        locale_dir: str = "/usr/share/locale",
        max_source_len: int = 64,
        max_target_len: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        seed: int = 42,
        vocab_size: int = 4000,
        max_pairs: int | None = None,
        tokenizer: str | None = None,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("max_source_len", max_source_len, minimum=2)
        check_positive_int("max_target_len", max_target_len, minimum=2)
        check_positive_int("batch_size", batch_size)
        check_fraction("val_fraction", val_fraction)
        check_positive_int("vocab_size", vocab_size, minimum=16)
        check_optional_positive_int("max_pairs", max_pairs, minimum=2)
        check_positive_int("num_workers", num_workers, minimum=0)
        validate_pretrained_tokenizer_args(tokenizer, None)
        languages = available_languages(locale_dir)
        if target_lang not in languages:
            raise ValueError(
                f"`target_lang={target_lang!r}` has no gettext catalogs under `locale_dir={locale_dir!r}`. "
                f"Available: {', '.join(languages) or 'none (is the directory right?)'}."
            )
        self.save_hyperparameters()
        self.target_lang = target_lang
        self.locale_dir = locale_dir
        self.max_source_len = max_source_len
        self.max_target_len = max_target_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.max_pairs = max_pairs
        self.tokenizer_path = tokenizer
        self.tokenizer_vocab_size = vocab_size
        self.num_workers = num_workers
        self.cache_root = resolve_cache_root(cache_dir, "translation")
        # Reading the catalogs takes well under a second; doing it here reports a thin image right away.
        self.all_pairs = extract_pairs(locale_dir, target_lang)
        if len(self.all_pairs) < MIN_PAIRS:
            raise ValueError(
                f"Only {len(self.all_pairs)} usable en-{target_lang} pairs in {locale_dir}/{target_lang}/LC_MESSAGES "
                f"(need {MIN_PAIRS}); this image carries few catalogs for {target_lang!r}. Try another "
                f"`target_lang` ({', '.join(languages)}) or install packages that ship translations."
            )

    # ------------------------------------------------------------------------------------------ pairs and split

    @cached_property
    def _split(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        order = seeded_permutation(len(self.all_pairs), self.seed)
        if self.max_pairs is not None:
            order = order[: self.max_pairs]
        num_val = min(max(1, round(self.val_fraction * len(order))), len(order) - 1)
        return (
            [self.all_pairs[i] for i in sorted(order[num_val:].tolist())],
            [self.all_pairs[i] for i in sorted(order[:num_val].tolist())],
        )

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """The ``(english, translation)`` pairs in use (after ``max_pairs``), train then validation."""
        return self._split[0] + self._split[1]

    @property
    def num_pairs(self) -> int:
        """Number of pairs in use (train + validation)."""
        return len(self._split[0]) + len(self._split[1])

    @property
    def train_pairs(self) -> list[tuple[str, str]]:
        """Training pairs in catalog order."""
        return self._split[0]

    @property
    def val_pairs(self) -> list[tuple[str, str]]:
        """Validation pairs in catalog order."""
        return self._split[1]

    # ------------------------------------------------------------------------------------------------ tokenizer

    @override
    def _tokenizer_texts(self) -> list[str]:
        return [text for pair in self.train_pairs for text in pair]

    def hf_config_overrides(self) -> dict[str, int]:
        """Fields the reference seq2seq module sets on its HF config (T5: the decoder starts from pad)."""
        ids = tokenizer_special_ids(self.tokenizer)
        return {"vocab_size": self.vocab_size, **ids, "decoder_start_token_id": ids["pad_token_id"]}

    # ------------------------------------------------------------------------------------------- tokenized data

    @override
    def _tokenized_key(self) -> tuple[Any, ...]:
        # The pairs depend on the split's content, the tokenizer and the max lengths.
        return (
            PAIRS_VERSION,
            self.target_lang,
            hash_texts(self._tokenizer_texts()),
            hash_texts(text for pair in self.val_pairs for text in pair),
            tokenizer_fingerprint(self.tokenizer),
            self.max_source_len,
            self.max_target_len,
        )

    @override
    def _stats_fields(self) -> dict[str, Any]:
        return {"target_lang": self.target_lang}

    @override
    def _tokenize_split(self, units: list[tuple[str, str]], fingerprint: str) -> tuple[Any, dict[str, Any]]:
        from datasets import Dataset, Features, Sequence, Value

        tokenizer = self.tokenizer
        max_source_len, max_target_len = self.max_source_len, self.max_target_len
        features = Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32"))})

        def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
            sources = tokenizer(batch["source"], max_length=max_source_len, truncation=True)["input_ids"]
            targets = tokenizer(text_target=batch["target"], max_length=max_target_len, truncation=True)["input_ids"]
            return {"input_ids": sources, "labels": targets}

        texts = Dataset.from_dict({"source": [s for s, _ in units], "target": [t for _, t in units]})
        tokens = texts.map(
            tokenize, batched=True, remove_columns=["source", "target"], features=features, new_fingerprint=fingerprint
        )
        return tokens, {
            "pairs": len(units),
            "source_tokens": sum(len(ids) for ids in tokens["input_ids"]),
            "target_tokens": sum(len(ids) for ids in tokens["labels"]),
        }

    # ------------------------------------------------------------------------------------------- Lightning hooks

    @override
    def _check_splits(self) -> None:
        self._require_full_training_batch("pairs", "Lower `batch_size` or raise `max_pairs`.")

    @property
    def stats(self) -> dict[str, Any]:
        """Pair and token counts per split plus the pairs found before ``max_pairs`` (after ``setup``)."""
        self._dataset("train")
        return {"pairs_found": len(self.all_pairs), **self._stats}

    @override
    def _collate_fn(self) -> Seq2SeqCollator:
        return Seq2SeqCollator(pad_token_id=self.hf_config_overrides()["pad_token_id"])
