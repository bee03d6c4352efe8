"""TranslationDataModule: catalog cleaning, real en-de/en-fr pairs, split, T5 batches, errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_hetero.data import TranslationDataModule
from lightning_hetero.data import translation as translation_module
from lightning_hetero.data.base import content_key, hash_texts
from lightning_hetero.data.tokenization import UNIGRAM_ALGORITHM_VERSION, tokenizer_fingerprint
from lightning_hetero.data.translation import MIN_PAIRS, available_languages, clean_pair, extract_pairs

LOCALE_DIR = Path("/usr/share/locale")
requires_catalogs = pytest.mark.skipif(
    not {"de", "fr"} <= set(available_languages(LOCALE_DIR)), reason="this image has no de/fr gettext catalogs"
)


def small(**overrides) -> TranslationDataModule:
    """1,200 pairs and a 500-token vocabulary: builds in about a second."""
    arguments = {"max_pairs": 1200, "vocab_size": 500, "batch_size": 8}
    arguments.update(overrides)
    return TranslationDataModule(**arguments)


@pytest.mark.parametrize(
    ("msgid", "msgstr", "expected"),
    [
        (
            "Floating point exception here",
            "Gleitkommafehler hier",
            ("Floating point exception here", "Gleitkommafehler hier"),
        ),
        (("file removed", "files removed"), "Datei entfernt", None),  # plural entry
        ("", "Content-Type: text/plain; charset=UTF-8", None),  # metadata
        ("cannot open %s for reading", "kann %s nicht lesen", None),  # printf placeholder
        ("Loading {name} from disk", "Lade {name} von der Platte", None),  # brace placeholder
        ("Too short", "Zu kurz", None),  # under 3 words
        ("Not translated here", "", None),
        # msgctxt prefix, doubled space and a GTK accelerator on each side
        (
            "Stock label\x04Save the  _file now",
            "Datei jetzt _speichern",
            ("Save the file now", "Datei jetzt speichern"),
        ),
        # an identifier copied verbatim into the translation is not an accelerator
        (
            "symbol _gp not defined",
            "Symbol _gp nicht definiert",
            ("symbol _gp not defined", "Symbol _gp nicht definiert"),
        ),
        ("first line\nsecond line here", "erste Zeile\nzweite Zeile", None),
    ],
)
def test_clean_pair_rules(msgid, msgstr, expected):
    assert clean_pair(msgid, msgstr) == expected


def test_synthetic_catalogs_extract_and_too_few_pairs_error(tmp_path: Path, write_mo):
    write_mo(tmp_path / "xx" / "LC_MESSAGES" / "app.mo", {"Open the file now": "Ouvrir le fichier", "Quit": "Q"})
    write_mo(tmp_path / "xx" / "LC_MESSAGES" / "iso_639.mo", {"German language name": "allemand nom de langue"})
    write_mo(tmp_path / "yy" / "LC_MESSAGES" / "app.mo", {"Open the file now": "Datei jetzt öffnen"})
    assert available_languages(tmp_path) == ["xx", "yy"]
    assert extract_pairs(tmp_path, "xx") == [("Open the file now", "Ouvrir le fichier")]
    with pytest.raises(ValueError, match=f"Only 1 usable en-xx pairs .* \\(need {MIN_PAIRS}\\)"):
        TranslationDataModule(target_lang="xx", locale_dir=str(tmp_path))


@requires_catalogs
def test_bad_target_lang_lists_the_available_languages():
    with pytest.raises(
        ValueError, match=r"`target_lang='klingon'` has no gettext catalogs.*Available: .*\bde\b.*\bfr\b"
    ):
        TranslationDataModule(target_lang="klingon")
    with pytest.raises(ValueError, match="`max_source_len` must be an integer >= 2"):
        TranslationDataModule(max_source_len=0)


@requires_catalogs
@pytest.mark.parametrize(("lang", "file_word"), [("de", "Datei"), ("fr", "fichier")])
def test_real_catalogs_give_over_1000_translation_pairs(lang: str, file_word: str):
    datamodule = TranslationDataModule(target_lang=lang)
    pairs = datamodule.pairs
    print(f"\n{lang}: {len(pairs)} pairs, e.g. {pairs[len(pairs) // 2]}")
    assert len(pairs) == datamodule.num_pairs >= MIN_PAIRS
    sources = [source for source, _ in pairs]
    assert len(set(sources)) == len(sources), "pairs must be deduplicated by English text"
    assert all(len(source.split()) >= 3 and "%" not in source + target for source, target in pairs)
    # Real translations: English "file" messages come back with the target language's word for it.
    file_pairs = [(s, t) for s, t in pairs if re.search(r"\bfile\b", s) and file_word in t]
    assert len(file_pairs) > 20, file_pairs[:5]
    assert sum(s != t for s, t in pairs) == len(pairs)


@requires_catalogs
def test_split_is_deterministic_disjoint_and_seeded():
    first, second, other = small(), small(), small(seed=7)
    assert first.val_pairs == second.val_pairs and first.train_pairs == second.train_pairs
    assert len(first.val_pairs) == 60 and len(first.train_pairs) == 1140  # 5% of max_pairs=1200
    assert not {s for s, _ in first.train_pairs} & {s for s, _ in first.val_pairs}
    assert other.val_pairs != first.val_pairs


@requires_catalogs
def test_t5_batches_are_padded_per_batch_with_minus_100_labels():
    datamodule = small(target_lang="fr")
    datamodule.prepare_data()
    datamodule.setup("fit")
    overrides = datamodule.hf_config_overrides()
    assert overrides == {
        "vocab_size": 500,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }
    assert len(datamodule.tokenizer) == datamodule.vocab_size == 500
    assert datamodule.tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "</s>", "<unk>"]
    batch = next(iter(datamodule.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(value.dtype == torch.long and value.shape[0] == 8 for value in batch.values())
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[1] <= 64 and batch["labels"].shape[1] <= 64
    padded = batch["attention_mask"] == 0
    assert bool(padded.any()), "a batch of different-length messages must contain padding"
    assert bool((batch["input_ids"][padded] == 0).all())
    lengths = batch["attention_mask"].sum(dim=1)
    assert bool((batch["input_ids"][torch.arange(8), lengths - 1] == 1).all()), "every source ends with </s>"
    label_lengths = (batch["labels"] != -100).sum(dim=1)
    assert bool((batch["labels"][torch.arange(8), label_lengths - 1] == 1).all()), "every target ends with </s>"
    assert bool((batch["labels"][batch["labels"] != -100] >= 0).all())
    assert int(label_lengths.min()) < batch["labels"].shape[1], "labels must be padded with -100"
    source, target = datamodule.val_pairs[0]
    val_example = datamodule.val_dataset[0]
    assert datamodule.tokenizer.decode(val_example["input_ids"], skip_special_tokens=True) == source
    print(f"\nexample pair: {source!r} -> {target!r}")


@requires_catalogs
def test_second_setup_hits_the_cache(isolated_cache: Path):
    first = small()
    first.prepare_data()
    (tokenizer_file,) = isolated_cache.glob("data/translation/tokenizers/unigram-*/tokenizer.json")
    mtime = tokenizer_file.stat().st_mtime_ns
    second = small()
    second.setup("fit")
    assert tokenizer_file.stat().st_mtime_ns == mtime
    assert len(list(isolated_cache.glob("data/translation/pairs/*"))) == 1
    # The cache keys (unchanged since the tokenizer and entry layout moved into TokenizedSplitsMixin).
    train_texts = [text for pair in second.train_pairs for text in pair]
    tokenizer_key = content_key(UNIGRAM_ALGORITHM_VERSION, hash_texts(train_texts), 500)
    assert tokenizer_file.parent == isolated_cache / "data/translation/tokenizers" / f"unigram-{tokenizer_key}"
    assert second.tokenized_dir == second.cache_root / "pairs" / content_key(
        translation_module.PAIRS_VERSION,
        "de",
        hash_texts(train_texts),
        hash_texts(text for pair in second.val_pairs for text in pair),
        tokenizer_fingerprint(second.tokenizer),
        64,
        64,
    )
