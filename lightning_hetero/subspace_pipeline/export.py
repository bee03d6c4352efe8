"""Fold a subspace-constrained model back into a plain Hugging Face checkpoint.

``W = U Z`` (reparam) or the dense projected weight, ``embed_tokens = T_fixed + E`` and an untied ``lm_head``: the
result is an ordinary Llama/Mistral/Qwen checkpoint whose logits equal the constrained model's (up to float
round-off), loadable by ``transformers.AutoModelForCausalLM.from_pretrained(path)`` with no code from this package.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hetero.subspace_pipeline.basis import FixedTokenTable, SubspaceConfig, parse_fixed_state

__all__ = ["dense_state_dict", "export_dense"]

_BASIS_KEY = "subspace.basis"
_FIXED_KEY = "subspace.fixed._extra_state"
_SKIPPED_KEYS = ("subspace.accumulated",)


def _merge(stage_state_dicts: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], list[Tensor], Any]:
    merged: dict[str, Any] = {}
    bases: list[Tensor] = []
    fixed_state = None
    for state in stage_state_dicts:
        for key, value in state.items():
            if key == _BASIS_KEY:
                bases.append(value)
            elif key == _FIXED_KEY:
                fixed_state = value
            elif key in _SKIPPED_KEYS:
                continue
            elif key in merged and not (torch.is_tensor(value) and torch.equal(merged[key], value)):
                raise ValueError(f"two stage state dicts hold different values for {key!r}; are they one pipeline?")
            else:
                merged[key] = value
    return merged, bases, fixed_state


def dense_state_dict(
    stage_state_dicts: Sequence[Mapping[str, Any]] | Mapping[str, Any], subspace_config: SubspaceConfig | None = None
) -> dict[str, Tensor]:
    """Merge stage state dicts (any order; or one whole-model state dict) into a plain HF causal-LM state dict.

    Args:
        stage_state_dicts: ``StageModule.state_dict()`` of every stage.
        subspace_config: Optional; when given, its seed must match the one recorded with ``T_fixed``.

    Raises:
        ValueError: stages disagree on U or on a shared key, or the seed does not match.
    """
    if isinstance(stage_state_dicts, Mapping):
        stage_state_dicts = [stage_state_dicts]
    merged, bases, fixed_state = _merge(stage_state_dicts)
    if not bases:  # compress=False: nothing to fold
        return {key: value for key, value in merged.items() if torch.is_tensor(value)}
    if any(not torch.equal(bases[0].cpu(), other.cpu()) for other in bases[1:]):
        raise ValueError("the stage state dicts hold different bases U; export them after the same subspace update.")
    if fixed_state is None:
        raise ValueError(f"no {_FIXED_KEY!r} (seed of T_fixed) in the state dicts; include the first stage's.")
    seed, std, vocab_size, hidden_size = parse_fixed_state(fixed_state)
    if subspace_config is not None and seed != subspace_config.seed:
        raise ValueError(
            f"the checkpoint's T_fixed seed {seed} differs from subspace_config.seed={subspace_config.seed}."
        )
    u = bases[0].detach().cpu().to(torch.float64)
    fixed = FixedTokenTable(vocab_size, hidden_size, seed, std, materialize=False)
    dense: dict[str, Tensor] = {}
    for key, value in merged.items():
        if not torch.is_tensor(value):
            continue
        value64 = value.detach().cpu().to(torch.float64)
        if key.endswith("embed_tokens.weight_coords"):
            folded = fixed.full(torch.float64) + value64 @ u.T
            dense[key.removesuffix("_coords")] = folded.to(value.dtype)
        elif key.endswith("embed_tokens.weight_in_span"):
            dense[key.removesuffix("_in_span")] = (fixed.full(torch.float64) + value64).to(value.dtype)
        elif key.endswith(".weight_coords"):
            dense[key.removesuffix("_coords")] = (u @ value64).to(value.dtype)
        elif key.endswith(".bias_coords"):
            dense[key.removesuffix("_coords")] = (u @ value64).to(value.dtype)
        else:
            dense[key] = value.detach().cpu()
    return dense


def export_dense(
    stages_or_state: nn.Module | Sequence[nn.Module] | Sequence[Mapping[str, Any]] | Mapping[str, Any],
    hf_config: Any,
    path: str | Path,
    tokenizer: Any = None,
    subspace_config: SubspaceConfig | None = None,
) -> Path:
    """Write a plain HF checkpoint (``config.json`` + ``model.safetensors``, tokenizer when given) to ``path``.

    Args:
        stages_or_state: Every stage module (or the whole-model module), or their state dicts (e.g. gathered to
            rank 0), or one merged state dict.
        hf_config: The original HF config (its ``tie_word_embeddings`` is turned off: the head is separate).
        path: Output directory (created).
        tokenizer: Saved with ``save_pretrained`` when given.
        subspace_config: Optional :class:`SubspaceConfig`, checked against the recorded seed.

    Returns:
        The output directory.

    Raises:
        ValueError: the folded keys do not match the HF model's keys (e.g. a stage is missing).
    """
    import transformers
    from safetensors.torch import save_file

    if isinstance(stages_or_state, nn.Module):
        states: Any = [stages_or_state.state_dict()]
    elif isinstance(stages_or_state, Mapping):
        states = [stages_or_state]
    else:
        states = [item.state_dict() if isinstance(item, nn.Module) else item for item in stages_or_state]
    dense = dense_state_dict(states, subspace_config)

    hf_config = copy.deepcopy(hf_config)
    hf_config.tie_word_embeddings = False
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(hf_config)]
    hf_config.architectures = [model_class.__name__]
    with torch.device("meta"):
        expected = set(model_class(hf_config).state_dict())
    missing, unexpected = sorted(expected - set(dense)), sorted(set(dense) - expected)
    if missing or unexpected:
        raise ValueError(
            f"cannot export: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected keys "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. Pass the state of every stage."
        )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {key: value.contiguous() for key, value in dense.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    hf_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
