"""Print the sizes of the offline data sets as JSON: ``python -m lightning_hetero.data [--only NAME] [--cache-dir D]``.

Timings are for this invocation: with a fresh ``--cache-dir`` they include training the tokenizers and tokenizing;
run it again to see the cached setup time (``cache_hit: true``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATASETS = ("shakespeare", "translation", "images")


def _cache_entries(root: Path) -> set[Path]:
    return {entry for folder in root.iterdir() if folder.is_dir() for entry in folder.iterdir()}


def _build_and_time(factory: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Construct a DataModule, run ``prepare_data`` + ``setup``; report the wall time and whether it hit the cache."""
    start = time.perf_counter()
    datamodule = factory()
    root = getattr(datamodule, "cache_root", None)
    before = _cache_entries(root) if root is not None else set()
    datamodule.prepare_data()
    datamodule.setup("fit")
    seconds = round(time.perf_counter() - start, 2)
    timing: dict[str, Any] = {"init_prepare_setup_s": seconds}
    if root is not None:
        timing["cache_hit"] = _cache_entries(root) == before
    return datamodule, timing


def _subdir(cache_dir: str | None, name: str) -> str | None:
    return None if cache_dir is None else str(Path(cache_dir) / name)


def shakespeare_stats(cache_dir: str | None) -> dict[str, Any]:
    """Corpus size, split and block counts of ``ShakespeareDataModule()`` with its defaults."""
    from lightning_hetero.data.shakespeare import ShakespeareDataModule

    datamodule, timing = _build_and_time(lambda: ShakespeareDataModule(cache_dir=_subdir(cache_dir, "shakespeare")))
    text = "\n\n".join(datamodule.sections)
    return {
        "plays": len(datamodule.play_files),
        "sections": len(datamodule.sections),
        "characters": len(text),
        "words": len(text.split()),
        **datamodule.stats,
        **timing,
    }


def translation_stats(cache_dir: str | None) -> dict[str, Any]:
    """Pair and token counts of ``TranslationDataModule(target_lang=...)`` for German and French."""
    from lightning_hetero.data.translation import TranslationDataModule

    result = {}
    for lang in ("de", "fr"):
        datamodule, timing = _build_and_time(
            lambda lang=lang: TranslationDataModule(target_lang=lang, cache_dir=_subdir(cache_dir, "translation"))
        )
        result[lang] = {**datamodule.stats, **timing}
    return result


def image_stats() -> dict[str, Any]:
    """Image counts per split of ``MNISTDataModule()`` and ``DigitsDataModule()``."""
    from lightning_hetero.data.images import DigitsDataModule, MNISTDataModule

    result = {}
    for name, factory in (("mnist", MNISTDataModule), ("digits", DigitsDataModule)):
        datamodule, timing = _build_and_time(factory)
        result[name] = {**datamodule.stats, **timing}
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Compute the statistics, print them as JSON and return them."""
    parser = argparse.ArgumentParser(prog="python -m lightning_hetero.data", description=__doc__)
    parser.add_argument("--only", choices=DATASETS, action="append", help="Data set(s) to measure (default: all).")
    parser.add_argument("--cache-dir", help="Cache root (default: $LIGHTNING_HETERO_CACHE/data).")
    args = parser.parse_args(argv)
    selected = args.only or list(DATASETS)
    stats: dict[str, Any] = {}
    if "shakespeare" in selected:
        stats["shakespeare"] = shakespeare_stats(args.cache_dir)
    if "translation" in selected:
        stats["translation"] = translation_stats(args.cache_dir)
    if "images" in selected:
        stats["images"] = image_stats()
    print(json.dumps(stats, indent=2))
    return stats


if __name__ == "__main__":
    main()
