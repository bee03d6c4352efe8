"""Loading a pretrained HF model offline (GGUF dequantized) and checking it against a datamodule's overrides."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from transformers import PretrainedConfig, PreTrainedModel

from lightning_hetero.utils.assets import require_module, resolve_path

# Datamodule overrides that name token ids: a pretrained model only needs them inside its vocabulary.
_TOKEN_ID_SUFFIX = "_token_id"


def require_gguf_support() -> None:
    """Raise a clear error naming the missing package if GGUF weights cannot be loaded here."""
    require_module("gguf", "loading GGUF weights (gguf_file)")
    require_module("accelerate", "loading GGUF weights (gguf_file)")


def load_pretrained(auto_model_class: Any, pretrained: str, gguf_file: str | None, dtype: torch.dtype) -> Any:
    """Load a model offline from a local directory (or ``pkg://`` path), dequantizing a GGUF file if given.

    A GGUF-loaded model keeps a ``quantization_config`` and refuses ``save_pretrained``; its dequantized weights are
    therefore copied into a clean model of the same class, which saves, checkpoints and shards like any other.
    """
    directory = resolve_path(pretrained)
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if gguf_file is not None:
        require_gguf_support()
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
