"""Validation loss/perplexity before and after ``fit``, printed side by side, through the module's own steps.

Lightning's sanity check runs a couple of validation batches before training but does not log them; fine-tuning
users want the number they started from. :class:`ValidationReport` evaluates the validation set (or a fair sample of
``limit_batches`` batches of it) when fit starts and when it ends, and prints both.

The evaluation helpers here are shared with MatFormer's
:class:`~lightning_hetero.strategies.matformer.callbacks.tier_eval.TierEvaluation`: they run the module's own
``validation_step`` (or its ``validation_loss(batch)`` hook) outside Lightning's loop, read the loss it returns or
logs, and leave no trace (nothing is logged through Lightning, torchmetrics states are restored).
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_hetero.data.base import fair_prefix

__all__ = [
    "DEFAULT_LOSS_NAMES",
    "HOOK",
    "ValidationReport",
    "batch_size_of",
    "check_evaluable",
    "mean_validation_loss",
    "validate_metric",
    "validation_loader",
]

#: Optional LightningModule method ``validation_loss(self, batch) -> scalar tensor`` that the evaluation callbacks
#: call instead of ``validation_step`` (for modules whose ``validation_step`` has side effects or returns no loss).
HOOK = "validation_loss"
#: Logged names read as the loss when ``validation_step`` returns none and no ``metric`` is given, in this order.
DEFAULT_LOSS_NAMES = ("val_loss", "val/loss")

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_MISSING = object()


class ValidationReport(Callback):
    """Evaluate validation loss and perplexity at the start and end of ``fit`` and print both.

    Works with any LightningModule that has a ``validation_step`` (or the ``validation_loss(batch)`` hook, see
    :func:`mean_validation_loss` for what is read and how). The value is averaged over batches weighted by batch
    size; perplexity is ``exp(value)``. The loader is the one Lightning's validation loop uses (the datamodule's,
    the module's own ``val_dataloader``, or ``fit(val_dataloaders=...)``), unsharded: every rank evaluates it whole,
    so sharded strategies whose forward needs all ranks still work; rank 0 prints. A module with neither hook fails
    in ``setup``, before the first step.

    Args:
        limit_batches: Evaluate ``limit_batches`` batches (None: all). A plain ``DataLoader`` in storage order is read
            in a fixed seeded order for this, so the batches are a fair sample and the same before and after.
        perplexity: Also report ``exp(value)`` (set False for classifiers).
        metric: Name the module logs (``self.log(metric, ...)``) or returns in a dict from ``validation_step`` to
            report. None: the loss ``validation_step`` returns (a tensor, or a dict's ``"loss"``), else the value it
            logs as ``val_loss`` or ``val/loss``.
    """

    def __init__(self, limit_batches: int | None = 20, perplexity: bool = True, metric: str | None = None) -> None:
        if limit_batches is not None and (
            isinstance(limit_batches, bool) or not isinstance(limit_batches, int) or limit_batches < 1
        ):
            raise ValueError(f"ValidationReport(limit_batches={limit_batches!r}): use a positive int or None for all.")
        self.limit_batches = limit_batches
        self.perplexity = perplexity
        self.metric = validate_metric("ValidationReport", metric)
        self.before: float | None = None
        self.after: float | None = None
        self._restored_before = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            check_evaluable("ValidationReport", pl_module, self.metric)

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> float:
        """Mean validation value of ``pl_module`` over (a fair sample of ``limit_batches`` of) the validation set."""
        loader = validation_loader(trainer, pl_module, "ValidationReport")
        return mean_validation_loss(
            trainer, pl_module, loader, self.limit_batches, "ValidationReport", metric=self.metric
        )

    def _describe(self, loss: float) -> str:
        text = f"{self.metric or 'loss'} {loss:.4f}"
        if self.perplexity:
            text += f", perplexity {math.exp(min(loss, 80.0)):.2f}"
        return text

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._restored_before:  # resumed run: "before" means before the first run, kept in the checkpoint
            self._restored_before = False
            rank_zero_info(f"[ValidationReport] before training (from checkpoint): {self._describe(self.before)}")
            return
        self.before = self.evaluate(trainer, pl_module)
        rank_zero_info(f"[ValidationReport] before training: {self._describe(self.before)}")

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.after = self.evaluate(trainer, pl_module)
        rank_zero_info(
            f"[ValidationReport] before training: {self._describe(self.before or float('nan'))}\n"
            f"[ValidationReport] after training:  {self._describe(self.after)}"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("before") is not None:
            self.before = state_dict["before"]
            self._restored_before = True


# ------------------------------------------------------------------------------------------- shared evaluation


def validate_metric(caller: str, metric: Any) -> str | None:
    """``metric`` after checking it is None or a non-empty string."""
    if metric is not None and (not isinstance(metric, str) or not metric.strip()):
        raise ValueError(
            f"{caller}(metric={metric!r}): pass the name validation_step logs (e.g. 'val_loss'), or None for the "
            "loss validation_step returns."
        )
    return metric


def _hook(pl_module: LightningModule) -> Any | None:
    """The module's ``validation_loss`` method, when its class defines one (an attribute of that name is not it)."""
    if not inspect.isfunction(getattr(type(pl_module), HOOK, None)):
        return None
    return getattr(pl_module, HOOK)


def check_evaluable(caller: str, pl_module: LightningModule, metric: str | None = None) -> None:
    """Raise ``TypeError`` saying what to add unless ``pl_module`` can be evaluated (call before training starts).

    Evaluation needs ``validation_step`` (overridden), or, when no ``metric`` is named, the ``validation_loss``
    hook.
    """
    if is_overridden("validation_step", pl_module):
        return
    name = type(pl_module).__name__
    if metric is not None:
        raise TypeError(
            f"{caller}(metric={metric!r}) reads what {name}.validation_step logs, but {name} has no validation_step. "
            f"Add `def validation_step(self, batch, batch_idx)` that calls self.log({metric!r}, value)."
        )
    if _hook(pl_module) is None:
        raise TypeError(
            f"{caller} evaluates through the module's own validation code, but {name} defines neither "
            f"validation_step nor {HOOK}. Add `def validation_step(self, batch, batch_idx)` that returns the loss "
            f"(or logs it as 'val_loss'), or `def {HOOK}(self, batch)` that returns the mean loss of the batch as a "
            "scalar tensor."
        )


def validation_loader(trainer: Trainer, pl_module: LightningModule, caller: str) -> Iterable[Any]:
    """The (first) validation loader Lightning's validation loop would use, before Lightning shards it.

    In Lightning's precedence: loaders passed to ``fit``/``validate``, else the datamodule's ``val_dataloader``,
    else the module's own.
    """
    loaders: Any = None
    # Lightning's record of where its validation loaders come from; private, hence the public fallbacks below.
    loop = trainer.validate_loop if trainer.validating else trainer.fit_loop.epoch_loop.val_loop
    source = getattr(loop, "_data_source", None)
    if source is not None and getattr(source, "instance", None) is not None and source.is_defined():
        loaders = source.dataloader()
    elif trainer.datamodule is not None and is_overridden("val_dataloader", trainer.datamodule):
        loaders = trainer.datamodule.val_dataloader()
    elif is_overridden("val_dataloader", pl_module):
        loaders = pl_module.val_dataloader()
    else:
        loaders = trainer.val_dataloaders
    if isinstance(loaders, Mapping):
        loaders = next(iter(loaders.values()), None)
    elif isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    if loaders is None:
        raise RuntimeError(
            f"{caller} needs a validation loader: define val_dataloader() in the LightningModule or the DataModule, "
            "or pass val_dataloaders to fit."
        )
    return loaders


def batch_size_of(batch: Any) -> int:
    """Examples in a batch: the first dimension of its first tensor (``labels`` first in a dict), else 1."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        values = ([batch["labels"]] if "labels" in batch else []) + list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return 1
    for value in values:
        if isinstance(value, (torch.Tensor, Mapping, list, tuple)):
            return batch_size_of(value)
    return 1


@contextmanager
def _captured_logs(pl_module: LightningModule) -> Iterator[dict[str, tuple[Any, int | None]]]:
    """Shadow ``pl_module.log`` (and so ``log_dict``) with a recorder: name -> (value, batch_size argument).

    Nothing reaches Lightning's result collection: our evaluation batches must not enter the module's logged
    ``val_loss``, and a ``sync_dist=True`` log must not start a collective on the one rank that evaluates.
    """
    logged: dict[str, tuple[Any, int | None]] = {}

    def log(*args: Any, **kwargs: Any) -> None:
        arguments = _LOG_SIGNATURE.bind(pl_module, *args, **kwargs).arguments
        logged[arguments["name"]] = (arguments["value"], arguments.get("batch_size"))

    previous = pl_module.__dict__.get("log", _MISSING)
    object.__setattr__(pl_module, "log", log)  # an instance attribute wins over the method
    try:
        yield logged
    finally:
        if previous is _MISSING:
            object.__delattr__(pl_module, "log")
        else:
            object.__setattr__(pl_module, "log", previous)


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copied(item) for item in value]
    return copy.deepcopy(value)


@contextmanager
def _kept_metric_states(pl_module: LightningModule) -> Iterator[None]:
    """Restore every torchmetrics ``Metric`` inside ``pl_module`` afterwards: its epoch value excludes our batches."""
    try:
        from torchmetrics import Metric
    except ImportError:  # no torchmetrics, no metric states to protect
        yield
        return
    saved = []
    for metric in pl_module.modules():
        if isinstance(metric, Metric):
            states = {name: _copied(getattr(metric, name)) for name in metric._defaults}
            saved.append((metric, states, metric._update_count, metric._computed, metric._forward_cache))
    try:
        yield
    finally:
        for metric, states, update_count, computed, forward_cache in saved:
            for name, value in states.items():
                setattr(metric, name, value)
            metric._update_count = update_count
            metric._computed = computed
            metric._forward_cache = forward_cache


def _as_float(value: Any, what: str, caller: str) -> float:
    if hasattr(value, "_forward_cache") and hasattr(value, "compute"):  # a torchmetrics Metric: this batch's value
        if value._forward_cache is None:
            raise TypeError(
                f"{caller}: {what} is a {type(value).__name__} that was not called on this batch, so it has no "
                "per-batch value. Call it (metric(preds, target)) before logging it, or log a tensor."
            )
        value = value._forward_cache
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{caller}: {what} must be a scalar (a one-element tensor or a number), got {value!r:.200}.")


def _batch_value(
    returned: Any, logged: dict[str, tuple[Any, int | None]], metric: str | None, caller: str, name: str
) -> tuple[float, int | None]:
    """The value to average for one batch, and the batch size the module logged it with (None: not given)."""
    if metric is not None:
        if metric in logged:
            value, size = logged[metric]
            return _as_float(value, f"the logged {metric!r}", caller), size
        if isinstance(returned, Mapping) and metric in returned:
            return _as_float(returned[metric], f"validation_step's returned {metric!r}", caller), None
        raise RuntimeError(
            f"{caller}(metric={metric!r}): {name}.validation_step neither logged nor returned {metric!r}; it logged "
            f"{sorted(logged)}. Pass one of those as metric=, or log {metric!r} in validation_step."
        )
    if isinstance(returned, (torch.Tensor, int, float)) and not isinstance(returned, bool):
        return _as_float(returned, "the loss validation_step returns", caller), None
    if isinstance(returned, Mapping) and "loss" in returned:
        return _as_float(returned["loss"], "validation_step's returned 'loss'", caller), None
    for candidate in DEFAULT_LOSS_NAMES:
        if candidate in logged:
            value, size = logged[candidate]
            return _as_float(value, f"the logged {candidate!r}", caller), size
    raise RuntimeError(
        f"{caller}: {name}.validation_step returned no loss ({type(returned).__name__}) and logged none of "
        f"{list(DEFAULT_LOSS_NAMES)}; it logged {sorted(logged)}. Return the loss from validation_step, or pass "
        f"{caller}(metric=...) naming the logged value to report."
    )


@torch.no_grad()
def mean_validation_loss(
    trainer: Trainer,
    pl_module: LightningModule,
    loader: Iterable[Any],
    limit: int | None,
    caller: str,
    metric: str | None = None,
) -> float:
    """Batch-size-weighted mean of the module's validation value over ``limit`` batches of ``loader``.

    Per batch (moved to the device with the module's transfer hooks): ``pl_module.validation_loss(batch)`` when the
    module defines that hook and ``metric`` is None; otherwise ``pl_module.validation_step(batch, batch_idx)``, read
    as ``metric`` (a name it logs, or a key of the dict it returns) or, with ``metric=None``, as the loss it returns
    (a tensor, or a dict's ``"loss"``), else the value it logs as ``val_loss`` / ``val/loss``. Weights are the
    ``batch_size`` the value was logged with, else the first dimension of the batch's first tensor.

    ``self.log`` calls are recorded, not passed to Lightning, and torchmetrics states are restored afterwards, so
    the module's own logged validation metrics are unchanged; other side effects of ``validation_step`` (appending
    to a list) do happen. Runs in eval mode under ``torch.no_grad()`` and the precision plugin's validation context,
    and restores the training mode. When ``limit`` is smaller than the loader, a plain ``DataLoader`` is read in a
    fixed seeded order (:func:`~lightning_hetero.data.base.fair_prefix`). ``caller`` names the callback in errors.
    """
    hook = _hook(pl_module) if metric is None else None
    name = type(pl_module).__name__
    was_training = pl_module.training
    pl_module.eval()
    total, count = 0.0, 0
    try:
        with trainer.precision_plugin.val_step_context(), _kept_metric_states(pl_module):
            for index, batch in enumerate(fair_prefix(loader, limit)):
                if limit is not None and index >= limit:
                    break
                batch = trainer.strategy.batch_to_device(batch)
                with _captured_logs(pl_module) as logged:
                    if hook is not None:
                        value, size = _as_float(hook(batch), f"{name}.{HOOK}(batch)", caller), None
                    else:
                        value, size = _batch_value(
                            pl_module.validation_step(batch, index), logged, metric, caller, name
                        )
                size = batch_size_of(batch) if size is None else int(size)
                total += value * size
                count += size
    finally:
        pl_module.train(was_training)
    if count == 0:
        raise RuntimeError(f"{caller}: the validation loader yielded no batches.")
    return total / count
