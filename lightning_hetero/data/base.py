"""Building blocks shared by the DataModules: argument checks, cache keys, atomic cache writes, splits, loaders.

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
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_hetero.data.stateful import StatefulDataLoader
from lightning_hetero.utils.assets import cache_dir as default_cache_dir

log = logging.getLogger(__name__)

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


# ------------------------------------------------------------------------------------------- evaluation order

#: Seed of the fixed evaluation order that :func:`fair_prefix` gives a loader (any fixed value; it never changes).
EVALUATION_ORDER_SEED = 0


class FixedOrderSampler(Sampler[int]):
    """Yields ``range(length)`` in one seeded permutation: the same order every epoch, on every process and run.

    Evaluation loaders use it so that their first ``N`` batches (``limit_val_batches``, a callback's
    ``limit_batches``) are a fair sample of a split that is stored in a meaningful order (sorted by class, by
    document), while every pass still sees the same batches.

    Args:
        length: Number of examples.
        seed: Seeds the permutation (numpy PCG64, platform-independent).
    """

    def __init__(self, length: int, seed: int) -> None:
        check_positive_int("length", length, minimum=0)
        self.seed = seed
        self.order: list[int] = seeded_permutation(length, seed).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def fair_prefix(loader: Iterable[Any], limit: int | None, seed: int = EVALUATION_ORDER_SEED) -> Iterable[Any]:
    """``loader``, rebuilt to read its dataset in a fixed seeded order when only its first ``limit`` batches are used.

    Reading the first ``limit`` batches of a loader in storage order evaluates whatever the file put first (one
    class of a class-sorted file, the first documents). When ``limit`` is smaller than ``len(loader)`` and the loader
    is a plain ``DataLoader`` over a sized map-style dataset with a sequential or random sampler, the result is the
    same loader (batch size, collate function, workers, ``drop_last``) over a :class:`FixedOrderSampler`: a fair
    sample, and the same batches on every call, rank and run. Anything else comes back unchanged: all batches are
    read (``limit`` None or not smaller), or the loader already has its own sampler or batch sampler (e.g. our
    DataModules' evaluation loaders, which are already in a fixed seeded order), or it cannot be re-read in another
    order (an ``IterableDataset``, a ``DataLoader`` subclass).
    """
    if limit is None or type(loader) is not DataLoader or loader.batch_size is None:
        return loader
    if not isinstance(loader.sampler, (SequentialSampler, RandomSampler)) or isinstance(
        loader.dataset, IterableDataset
    ):
        return loader
    try:
        length = len(loader.dataset)  # type: ignore[arg-type]
        if limit >= len(loader):
            return loader
    except TypeError:  # an unsized dataset
        return loader
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=FixedOrderSampler(length, seed),
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        persistent_workers=loader.persistent_workers,
    )


# ---------------------------------------------------------------------------------------------------- dataloaders


def make_dataloader(
    dataset: Any,
    *,
    batch_size: int,
    train: bool,
    num_workers: int,
    seed: int,
    collate_fn: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
    ordered: bool = False,
) -> DataLoader:
    """Training loaders shuffle by ``seed + epoch``, drop the last partial batch and are resumable mid-epoch.

    Training loaders are :class:`~lightning_hetero.data.stateful.StatefulDataLoader`: the Trainer (and Fabric, when
    the loader is in the saved state) checkpoint their position, so a resumed run continues with the next batch.
    Evaluation loaders are plain and read the split in one fixed seeded order (:class:`FixedOrderSampler`, from
    ``seed``), the same every pass, process and run, so their first batches are a fair sample of a split stored in a
    meaningful order (by class, by document); ``ordered=True`` keeps storage order instead (predictions). No
    distributed sampler is set: in distributed runs the Trainer swaps in a ``DistributedSampler`` (it keeps
    ``shuffle``; the loader's position still applies to it), or wraps the fixed order in a
    ``DistributedSamplerWrapper``, which deals it out to the ranks in that order.
    """
    common: dict[str, Any] = {
        "batch_size": batch_size,
        "drop_last": train,
        "num_workers": num_workers,
        "persistent_workers": num_workers > 0,
        "collate_fn": collate_fn,
    }
    if train:
        return StatefulDataLoader(dataset, shuffle=True, seed=seed, **common)
    if ordered:
        return DataLoader(dataset, shuffle=False, **common)
    return DataLoader(dataset, sampler=FixedOrderSampler(len(dataset), seed), **common)


class DatasetSplitsMixin:
    """Shared by our DataModules: ``train``/``validation`` datasets built in ``setup``, and their loaders.

    Subclasses call ``super().__init__()``, fill ``self._datasets = {"train": ..., "validation": ...}`` in ``setup()``
    and set ``batch_size``, ``num_workers`` and ``seed``. There is no third split: the offline corpora are small, so
    ``test_dataloader()`` and ``predict_dataloader()`` read the validation split and ``lightning-hetero test`` /
    ``predict`` evaluate the held-out validation data (validation and test in a fixed seeded order, predict in
    storage order). Put the mixin before ``LightningDataModule`` in the bases.
    """

    batch_size: int
    num_workers: int
    seed: int

    def __init__(self) -> None:
        super().__init__()
        self._datasets: dict[str, Any] = {}
        self._stats: dict[str, Any] = {}

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

    def _collate_fn(self) -> Callable[[list[dict[str, Any]]], dict[str, Any]] | None:
        """Subclass hook: the loaders' batch collator (None: PyTorch's default collation)."""
        return None

    def _loader(self, split: str, train: bool, ordered: bool = False) -> DataLoader:
        return make_dataloader(
            self._dataset(split),
            batch_size=self.batch_size,
            train=train,
            num_workers=self.num_workers,
            seed=self.seed,
            collate_fn=self._collate_fn(),
            ordered=ordered,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded) training batches; the last partial batch is dropped."""
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed seeded order (a fair sample from the first batch on; the same every pass)."""
        return self._loader("validation", train=False)

    def test_dataloader(self) -> DataLoader:
        """The validation loader (see the class docstring)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The validation split in storage order, so that prediction ``i`` belongs to example ``i``."""
        return self._loader("validation", train=False, ordered=True)
