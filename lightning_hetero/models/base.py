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
from dataclasses import dataclass
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torchmetrics import Metric
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from typing_extensions import override

from lightning_hetero.models.presets import build_config, check_config_keys, preset_model_type
from lightning_hetero.utils.assets import require_module, resolve_path

#: Accepted values of the ``dtype`` argument.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

#: The stages that own a set of evaluation metrics.
EVAL_STAGES: tuple[str, ...] = ("val", "test")

# Datamodule overrides that name token ids: a pretrained model only needs them inside its vocabulary.
_TOKEN_ID_SUFFIX = "_token_id"


@dataclass
class WarmupCosineSchedule:
    """LR multiplier: linear warmup, then cosine decay to ``min_lr_ratio``; used as a ``LambdaLR`` lambda.

    ``step`` is the number of optimizer steps already taken. Warmup climbs as ``(step + 1) / (warmup_steps + 1)``
    so that the first step already learns and the peak (1.0) is reached at ``step == warmup_steps``; the cosine then
    reaches exactly ``min_lr_ratio`` at the last step, ``total_steps - 1``. With ``total_steps=None`` (unknown or
    infinite training length) the multiplier stays at 1.0 after warmup.

    A callable object rather than a closure so that ``LambdaLR.state_dict()`` stores its fields in checkpoints.
    """

    warmup_steps: int
    total_steps: int | None
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.total_steps is None:
            return 1.0
        decay_steps = max(1, self.total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


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
        _validate_optimizer_arguments(learning_rate, weight_decay, betas, warmup_steps, min_lr_ratio)
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
                require_module("gguf", "loading GGUF weights (gguf_file)")
                require_module("accelerate", "loading GGUF weights (gguf_file)")
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
def _validate_optimizer_arguments(
    learning_rate: float, weight_decay: float, betas: tuple[float, float], warmup_steps: int, min_lr_ratio: float
) -> None:
    if not (isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate!r}.")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be >= 0 (0 disables it), got {weight_decay!r}.")
    if len(tuple(betas)) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), e.g. (0.9, 0.95); got {betas!r}.")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}.")
    if not (isinstance(min_lr_ratio, (int, float)) and 0.0 <= min_lr_ratio <= 1.0):
        raise ValueError(f"min_lr_ratio must be in [0, 1] (final fraction of learning_rate), got {min_lr_ratio!r}.")


def _batch_size(batch: Mapping[str, torch.Tensor]) -> int:
    tensor = batch.get("labels")
    if tensor is None:
        tensor = next(iter(batch.values()))
    return int(tensor.shape[0])


def load_pretrained(auto_model_class: Any, pretrained: str, gguf_file: str | None, dtype: torch.dtype) -> Any:
    """Load a model offline from a local directory (or ``pkg://`` path), dequantizing a GGUF file if given.

    A GGUF-loaded model keeps a ``quantization_config`` and refuses ``save_pretrained``; its dequantized weights are
    therefore copied into a clean model of the same class, which saves, checkpoints and shards like any other.
    """
    directory = resolve_path(pretrained)
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if gguf_file is not None:
        require_module("gguf", "loading GGUF weights (gguf_file)")
        require_module("accelerate", "loading GGUF weights (gguf_file)")
        kwargs["gguf_file"] = gguf_file
    model = auto_model_class.from_pretrained(directory, **kwargs)
    if getattr(model.config, "quantization_config", None) is not None:
        model = dequantized_copy(model, dtype)
    return model


def dequantized_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """Copy a loaded quantized model (e.g. from GGUF) into a plain model of the same class and config.

    Raises:
        RuntimeError: the weights do not map one to one (anything but tied weights missing, or extra weights).
    """
    from transformers.initialization import no_init_weights

    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    clean_config = type(model.config).from_dict(config_dict)
    with no_init_weights():  # every weight is overwritten below; skip the random initialisation
        clean = type(model)(clean_config)
    missing, unexpected = clean.load_state_dict(model.state_dict(), strict=False)
    tied = set(getattr(clean, "_tied_weights_keys", None) or ())
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise RuntimeError(
            f"Copying the dequantized weights into a clean {type(model).__name__} failed: missing={missing}, "
            f"unexpected={unexpected}."
        )
    clean.tie_weights()
    clean.generation_config = model.generation_config
    return clean.to(dtype=dtype)


def check_pretrained_compatibility(config: PretrainedConfig, data_overrides: Mapping[str, Any]) -> None:
    """Check a pretrained model against the datamodule's ``hf_config_overrides()`` instead of applying them.

    * ``vocab_size``: the tokenizer's vocabulary must fit the model's embedding (may be smaller).
    * ``*_token_id``: must lie inside the model's vocabulary; missing ids are filled in, differing ones warn.
    * anything else present on the config (``image_size``, ``num_channels``, ``num_labels``, ...) must be equal.

    Raises:
        ValueError: naming the mismatching key, both values, and the fix.
    """
    model_vocab = getattr(config, "vocab_size", None)
    for key, wanted in data_overrides.items():
        if key == "vocab_size":
            if model_vocab is not None and wanted > model_vocab:
                raise ValueError(
                    f"The datamodule's tokenizer has vocab_size={wanted}, larger than the pretrained model's embedding "
                    f"({model_vocab} rows): token ids >= {model_vocab} would crash. Use the model's own tokenizer."
                )
        elif key.endswith(_TOKEN_ID_SUFFIX):
            if wanted is None:
                continue
            ids = wanted if isinstance(wanted, (list, tuple)) else [wanted]
            if model_vocab is not None and any(token_id >= model_vocab for token_id in ids):
                raise ValueError(
                    f"The datamodule's {key}={wanted} is outside the pretrained model's vocabulary ({model_vocab})."
                )
            current = getattr(config, key, None)
            if current is None:
                setattr(config, key, wanted)
            elif current != wanted:
                rank_zero_warn(
                    f"The datamodule's {key}={wanted} differs from the pretrained model's {key}={current}; the "
                    f"model keeps its own. Check that the datamodule uses the model's tokenizer."
                )
        elif hasattr(config, key) and getattr(config, key) != wanted:
            raise ValueError(
                f"The datamodule needs {key}={wanted!r} but the pretrained model has {key}={getattr(config, key)!r}. "
                f"Use a datamodule that matches the model, or train from a preset."
            )
