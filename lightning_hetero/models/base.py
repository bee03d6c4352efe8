"""Shared LightningModule machinery for the reference Hugging Face models.

:class:`HFModuleBase` owns what the causal-LM, seq2seq and image-classification modules have in common:

* the model source (a preset, a config dict, or a pretrained directory / GGUF file), validated in ``__init__``;
* building the HF model in :meth:`~HFModuleBase.configure_model`, not in ``__init__``, so that sharding strategies
  can build it in place, and applying the datamodule's ``hf_config_overrides()`` (vocabulary size, token ids,
  image geometry) on the way;
* AdamW with decoupled weight decay on matrices only, and a per-step linear-warmup + cosine-decay schedule;
* the training step (the HF loss) and an evaluation step that logs ``<stage>/loss`` plus the subclass' metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torchmetrics import Metric
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from typing_extensions import override

from lightning_hetero.models.optimization import WarmupCosineSchedule, validate_optimizer_arguments
from lightning_hetero.models.presets import build_config, check_config_keys, preset_model_type
from lightning_hetero.models.pretrained import (
    check_pretrained_compatibility,
    load_pretrained,
    require_gguf_support,
)
from lightning_hetero.utils.assets import resolve_path

# The schedule and the pretrained-model helpers lived here before; they stay importable from this module.
__all__ = [
    "DTYPES",
    "EVAL_STAGES",
    "HFModuleBase",
]

#: Accepted values of the ``dtype`` argument.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

#: The stages that own a set of evaluation metrics.
EVAL_STAGES: tuple[str, ...] = ("val", "test")


class HFModuleBase(L.LightningModule):
    """Base LightningModule around one Hugging Face ``PreTrainedModel``, built in :meth:`configure_model`.

    Subclasses set :attr:`auto_model_class` and implement :meth:`build_metrics` and :meth:`update_metrics`.

    Model source, in order of precedence:

    1. ``pretrained``: a local directory or ``pkg://<package>[/sub/dir]`` loaded offline with
       ``from_pretrained`` (``gguf_file`` names a GGUF file inside it). ``preset`` is then ignored and ``config``
       must be None.
    2. ``config`` with a ``model_type`` and ``preset=None``: built with ``AutoConfig.for_model(**config)``.
    3. ``preset`` (see :mod:`lightning_hetero.models.presets`), with ``config`` as overrides.

    Args:
        preset: Preset name such as ``"llama-tiny"``; ignored when ``pretrained`` is set.
        config: HF config keywords: overrides of the preset, or, with ``preset=None``, a full config including
            ``model_type``. Values given here win over the datamodule's ``hf_config_overrides()``.
        pretrained: Local directory (or ``pkg://`` path) of a saved HF model; loaded with ``local_files_only``.
        gguf_file: File name of a GGUF checkpoint inside ``pretrained``; weights are dequantized on load.
        dtype: Parameter dtype, one of :data:`DTYPES`.
        learning_rate: Peak learning rate of AdamW.
        weight_decay: Decoupled weight decay, applied only to the matrices of linear/conv layers (not to biases,
            norms, embedding tables, position embeddings or class tokens: decaying those just shrinks lookups
            and scales that are not prone to over-fitting).
        betas: AdamW ``(beta1, beta2)``.
        warmup_steps: Optimizer steps of linear warmup.
        min_lr_ratio: The cosine decays the learning rate to ``min_lr_ratio * learning_rate`` at the last step.
    """

    #: ``transformers`` auto class used to build/load the model (e.g. ``AutoModelForCausalLM``).
    auto_model_class: ClassVar[Any] = None
    #: The metric logged with ``prog_bar=True`` at evaluation, besides the loss (None: only the loss).
    progress_bar_metric: ClassVar[str | None] = None

    def __init__(
        self,
        preset: str | None = None,
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        gguf_file: str | None = None,
        dtype: str = "float32",
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if self.auto_model_class is None:
            raise TypeError(f"{type(self).__name__} must set the class attribute `auto_model_class`.")
        validate_optimizer_arguments(learning_rate, weight_decay, betas, warmup_steps, min_lr_ratio)
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}.")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict of HF config keywords, got {type(config).__name__}.")
        self._validate_model_source(preset, dict(config or {}), pretrained, gguf_file)
        self.model: PreTrainedModel | None = None
        # Filled by configure_model, once the config (vocabulary, number of labels) is known.
        self.eval_metrics = nn.ModuleDict()

    # ------------------------------------------------------------------------------------------------ model source
    def _validate_model_source(
        self, preset: str | None, config: dict[str, Any], pretrained: str | None, gguf_file: str | None
    ) -> None:
        """Reject contradictory or unusable model sources before any training starts."""
        if pretrained is not None:
            if config:
                raise ValueError(
                    "config cannot be combined with pretrained: a pretrained model's architecture comes from its "
                    "files. Drop `config`, or drop `pretrained` to train from a preset/config."
                )
            try:
                directory = resolve_path(pretrained)
            except FileNotFoundError as error:
                # Loading is offline by design (no hub access at run time): say how to get a hub model locally.
                raise FileNotFoundError(
                    f"pretrained={pretrained!r} is not a local directory or pkg:// path. Models load offline; for a "
                    f"Hub model id, download it first (`hf download {pretrained} --local-dir <dir>`) and pass "
                    "pretrained=<dir>."
                ) from error
            if gguf_file is not None:
                require_gguf_support()
                if not (directory / gguf_file).is_file():
                    available = sorted(path.name for path in directory.glob("*.gguf"))
                    raise FileNotFoundError(
                        f"gguf_file={gguf_file!r} is not in {directory}. GGUF files there: {available or 'none'}."
                    )
            return
        if gguf_file is not None:
            raise ValueError("gguf_file needs pretrained=<directory that contains it>; set pretrained too.")
        model_type = config.get("model_type")
        if preset is None:
            if model_type is None:
                raise ValueError(
                    "No model source: set preset (e.g. 'llama-tiny'), pretrained=<directory>, or a config that "
                    "contains model_type."
                )
            check_config_keys(model_type, config)
            static_config = AutoConfig.for_model(**config)
        else:
            preset_type = preset_model_type(preset)  # raises on an unknown preset, listing the available ones
            if model_type is not None and model_type != preset_type:
                raise ValueError(
                    f"config['model_type']={model_type!r} contradicts preset={preset!r} ({preset_type}). Pass "
                    f"preset=None to build from config alone, or use a {model_type} preset."
                )
            static_config = build_config(preset, config)
        self._check_model_class(static_config)

    def _check_model_class(self, config: PretrainedConfig) -> None:
        if type(config) not in self.auto_model_class._model_mapping:
            raise ValueError(
                f"{type(self).__name__} builds models with {self.auto_model_class.__name__}, which has no class for "
                f"model_type {config.model_type!r}. Pick another preset/model_type or another module."
            )

    def data_config_overrides(self) -> dict[str, Any]:
        """HF config values required by the attached datamodule (``trainer.datamodule.hf_config_overrides()``).

        Returns an empty dict when no Trainer is attached (direct calls, ``load_from_checkpoint``), under Fabric, or
        when the datamodule does not implement the method.
        """
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer
            return {}
        datamodule = getattr(trainer, "datamodule", None)  # the Fabric shim raises AttributeError -> None
        provider = getattr(datamodule, "hf_config_overrides", None)
        if provider is None:
            return {}
        overrides = provider()
        if not isinstance(overrides, Mapping):
            raise TypeError(
                f"{type(datamodule).__name__}.hf_config_overrides() must return a dict of HF config keywords, "
                f"got {type(overrides).__name__}."
            )
        return dict(overrides)

    def build_scratch_config(self, data_overrides: Mapping[str, Any]) -> PretrainedConfig:
        """The config of a model trained from scratch: preset or ``config``, then datamodule values, then ``config``."""
        user_config = dict(self.hparams.config or {})
        merged = {**data_overrides, **user_config}
        if self.hparams.preset is None:
            check_config_keys(user_config["model_type"], merged)
            return AutoConfig.for_model(**merged)
        return build_config(self.hparams.preset, merged)

    def build_model(self) -> PreTrainedModel:
        """Build (or load) the HF model, honouring the datamodule's ``hf_config_overrides()``."""
        data_overrides = self.data_config_overrides()
        dtype = DTYPES[self.hparams.dtype]
        if self.hparams.pretrained is not None:
            model = load_pretrained(self.auto_model_class, self.hparams.pretrained, self.hparams.gguf_file, dtype)
            check_pretrained_compatibility(model.config, data_overrides)
            self.validate_config(model.config)
            return model
        config = self.build_scratch_config(data_overrides)
        self.validate_config(config)
        if data_overrides:
            # Record the datamodule's values as explicit config so that `load_from_checkpoint` (which calls
            # configure_model without a Trainer) rebuilds the same shapes. Explicit values still win.
            self.hparams["config"] = {**data_overrides, **dict(self.hparams.config or {})}
        return self.auto_model_class.from_config(config).to(dtype=dtype)

    def validate_config(self, config: PretrainedConfig) -> None:
        """Subclass hook: raise a clear error if the final config cannot work (called before training)."""

    @override
    def configure_model(self) -> None:
        # Lightning may call this more than once (e.g. fit after load_from_checkpoint): build only once.
        if self.model is not None:
            return
        self.model = self.build_model()
        self.eval_metrics = nn.ModuleDict({stage: self._fresh_metrics(torch.device("cpu")) for stage in EVAL_STAGES})

    def _fresh_metrics(self, device: torch.device) -> nn.ModuleDict:
        # Real CPU tensors even when configure_model runs under a strategy's meta-device init context.
        with torch.device("cpu"):
            metrics = nn.ModuleDict(self.build_metrics(self.model.config))
        return metrics.to(device)

    # ------------------------------------------------------------------------------------------------ steps
    @override
    def forward(self, **batch: torch.Tensor) -> Any:
        """Run the HF model on a batch dict and return its output (``.loss``, ``.logits``, ...)."""
        if self.model is None:
            raise RuntimeError(
                f"{type(self).__name__}.model is not built yet: call configure_model() first (the Trainer does)."
            )
        return self.model(**batch)

    def _loss(self, outputs: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if outputs.loss is None:
            raise ValueError(f"The batch has no 'labels', so the model returned no loss. Batch keys: {sorted(batch)}.")
        return outputs.loss

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(self(**batch), batch)
        # No sync_dist: a per-step all-reduce just for logging would cost a round trip over the slow link.
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=_batch_size(batch))
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.evaluation_step(batch, "val")

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.evaluation_step(batch, "test")

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """Per-example predictions for ``trainer.predict`` / ``lightning-hetero predict`` (see :meth:`predictions`)."""
        return self.predictions(self(**batch), batch)

    def predictions(self, outputs: Any, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Subclass hook: turn one batch's model outputs into a dict of per-example tensors."""
        raise NotImplementedError

    def evaluation_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        """Log ``<stage>/loss`` (epoch mean over all ranks) and update and log the stage's metrics."""
        outputs = self(**batch)
        loss = self._loss(outputs, batch)
        batch_size = _batch_size(batch)
        self.log(f"{stage}/loss", loss, prog_bar=True, on_epoch=True, sync_dist=True, batch_size=batch_size)
        metrics = self.eval_metrics[stage]
        self.update_metrics(metrics, outputs, batch)
        for name, metric in metrics.items():
            # torchmetrics synchronises its own state across ranks at compute time.
            prog_bar = name == self.progress_bar_metric
            self.log(
                f"{stage}/{name}",
                metric,
                prog_bar=prog_bar,
                on_epoch=True,
                batch_size=batch_size,
                metric_attribute=f"eval_metrics.{stage}.{name}",  # the objects are replaced every epoch
            )
        return loss

    @override
    def on_validation_epoch_start(self) -> None:
        self._reset_metrics("val")

    @override
    def on_test_epoch_start(self) -> None:
        self._reset_metrics("test")

    def _reset_metrics(self, stage: str) -> None:
        # New metric objects every evaluation epoch, on the model's device. `reset()` would not do: a strategy that
        # materialises the module with `to_empty` fills metric states *and* their stored defaults with garbage.
        device = next(self.model.parameters()).device
        self.eval_metrics[stage] = self._fresh_metrics(device)

    def build_metrics(self, config: PretrainedConfig) -> dict[str, Metric]:
        """Subclass hook: fresh metrics for one stage, keyed by the name logged after ``<stage>/``."""
        return {}

    def update_metrics(self, metrics: nn.ModuleDict, outputs: Any, batch: Mapping[str, torch.Tensor]) -> None:
        """Subclass hook: update ``metrics`` (from :meth:`build_metrics`) with one batch."""

    # ------------------------------------------------------------------------------------------------ optimizer
    def parameter_groups(self) -> list[dict[str, Any]]:
        """AdamW groups: decay for ``weight`` matrices of non-embedding modules, no decay for everything else.

        A tied weight (e.g. GPT-2's token embedding that is also its LM head) is listed once, without decay.
        """
        if self.model is None:
            raise RuntimeError("configure_model() must run before the optimizer is built.")
        decays: dict[int, bool] = {}
        parameters: dict[int, nn.Parameter] = {}
        for module in self.model.modules():
            for name, parameter in module.named_parameters(recurse=False):
                if not parameter.requires_grad:
                    continue
                is_matrix = name == "weight" and parameter.ndim >= 2 and not isinstance(module, nn.Embedding)
                key = id(parameter)
                parameters[key] = parameter
                decays[key] = decays.get(key, True) and is_matrix  # any embedding owner wins: no decay
        decay = [parameters[key] for key, flag in decays.items() if flag]
        no_decay = [parameters[key] for key, flag in decays.items() if not flag]
        return [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def total_training_steps(self) -> int | None:
        """Optimizer steps of the run from ``trainer.estimated_stepping_batches``; None if unknown or infinite."""
        try:
            estimate = self.trainer.estimated_stepping_batches
        except (RuntimeError, AttributeError):  # detached, or Fabric (no estimate)
            estimate = None
        if estimate is None or not math.isfinite(estimate) or estimate <= 0:
            rank_zero_warn(
                "The number of training steps is unknown or infinite (max_steps=-1 with an endless dataloader, or "
                "no Trainer), so the learning rate stays constant after warmup. Set Trainer(max_steps=...) for the "
                "cosine decay."
            )
            return None
        return int(estimate)

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            self.parameter_groups(), lr=self.hparams.learning_rate, betas=tuple(self.hparams.betas)
        )
        total_steps = self.total_training_steps()
        if total_steps is not None and self.hparams.warmup_steps >= total_steps:
            rank_zero_warn(
                f"warmup_steps={self.hparams.warmup_steps} >= the run's {total_steps} optimizer steps: the run ends "
                f"before warmup does. Lower warmup_steps."
            )
        schedule = WarmupCosineSchedule(self.hparams.warmup_steps, total_steps, self.hparams.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


# ---------------------------------------------------------------------------------------------------- helpers
def _batch_size(batch: Mapping[str, torch.Tensor]) -> int:
    tensor = batch.get("labels")
    if tensor is None:
        tensor = next(iter(batch.values()))
    return int(tensor.shape[0])
