"""Write a layerwise-trained model as an ordinary model: what ``GreedyLayerwise(export_dir=...)`` and
``LayerwiseStrategy(export_dir=...)`` (DGL) leave after fit.

The format is the same for both: an HF model is written with ``save_pretrained`` (``config.json`` +
``model.safetensors``; ``from_pretrained`` loads it), any other model (a CNN given as ``nn.Sequential``) as its
``state_dict`` in ``model.pt``. Auxiliary heads are never part of it.

A DGL pipeline holds the model in pieces, one stage per rank: :func:`stage_export_state` is a stage's share under the
whole model's state-dict names, :func:`merge_stage_states` joins the shares of every stage, and
:func:`save_model` writes them. Nothing here imports Lightning.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["export_bytes_limit", "merge_stage_states", "save_model", "stage_export_state"]

STATE_FILE = "model.pt"
"""File name of a non-HF export (the model's ``state_dict``)."""

_HEADER_BYTES_PER_TENSOR = 512  # a safetensors header entry: the name, dtype, shape and offsets as JSON


def export_bytes_limit(root: nn.Module) -> int:
    """The most bytes one stage's serialized share of ``root`` can take: the whole model's tensors (every element
    counted at 4 bytes at least, so a stage in fp32 fits a bf16 layout) plus room for the safetensors header.

    Rank 0 bounds what each stage announces by it before allocating anything (the peer-payload rule). ``root`` may
    be a stage's hollow model: the tensors other stages hold are on the meta device but keep their shapes.
    """
    tensors = list(root.state_dict().values())
    payload = sum(t.numel() * max(t.element_size(), 4) for t in tensors)
    return payload + _HEADER_BYTES_PER_TENSOR * (len(tensors) + 8) + (1 << 20)


def stage_export_state(root: nn.Module) -> dict[str, Tensor]:
    """The tensors this stage holds, under the whole model's state-dict names (CPU, detached).

    ``root`` is the model a DGL stage was cut from (:attr:`BlockStack.root`): the parts other stages train were moved
    to the meta device, so what is not on meta is this stage's (its stem, block and, on the last stage, the model's
    head; auxiliary heads are not part of ``root``).
    """
    return {name: value.detach().cpu() for name, value in root.state_dict().items() if value.device.type != "meta"}


def merge_stage_states(states: Sequence[Mapping[str, Tensor]], root: nn.Module) -> dict[str, Tensor]:
    """Join every stage's :func:`stage_export_state` into the whole model's state dict.

    Raises:
        ValueError: a key of the model that no stage holds (a stage's state is missing), or one no model has.
    """
    merged: dict[str, Tensor] = {}
    for state in states:
        for name, value in state.items():
            merged.setdefault(name, value)
    expected = set(root.state_dict())
    missing, unexpected = sorted(expected - set(merged)), sorted(set(merged) - expected)
    if missing or unexpected:
        raise ValueError(
            f"cannot export the layerwise model: no stage holds {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"and {unexpected[:5]} are not the model's. Pass the state of every stage, in stage order."
        )
    return merged


def save_model(root: nn.Module, state: Mapping[str, Tensor], path: str | Path, untie: bool = False) -> Path:
    """Write ``state`` (the whole model's state dict) as the model ``root`` is: HF ``save_pretrained``, else
    ``model.pt``.

    Args:
        root: The model (or its hollow shell: only its class and config are used for an HF model).
        state: The whole model's state dict, e.g. from :func:`merge_stage_states`.
        path: Output directory (created).
        untie: The input embedding and the LM head were trained as separate tensors (DGL: the first and the last
            stage each own a copy): the exported config has ``tie_word_embeddings=False``.

    Returns:
        The output directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = getattr(root, "config", None)
    if not hasattr(root, "save_pretrained") or config is None:
        torch.save({name: value.detach().cpu() for name, value in state.items()}, out / STATE_FILE)
        return out
    config = copy.deepcopy(config)
    if untie and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
    with torch.device("meta"):  # the shell only: every saved tensor comes from ``state``
        model = type(root)(config)
    model.load_state_dict(dict(state), strict=True, assign=True)
    model.save_pretrained(out)
    return out
