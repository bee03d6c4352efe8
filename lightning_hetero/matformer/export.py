"""Export one tier of a MatFormer model as a standard Hugging Face checkpoint.

The result is what ``save_pretrained`` writes for a dense model whose FFN size is ``h >> tier``: safetensors weights
and a config with the reduced size in the family's field (``intermediate_size``, GPT-2 ``n_inner``, T5 ``d_ff``), plus
``matformer_tier`` / ``matformer_base_intermediate_size`` metadata that transformers ignores. Plain
``AutoModel*.from_pretrained(path)`` loads it, and its logits equal ``tier_view(model, tier)`` of the full model.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from lightning_hetero.matformer.adapters import find_ffns, intermediate_size_field
from lightning_hetero.matformer.slicing import apply_widths, resolve_widths


def _find_pretrained_model(model: nn.Module) -> PreTrainedModel:
    """``model`` itself if it is an HF model, else the one outermost HF model inside it (e.g. a LightningModule's)."""
    if isinstance(model, PreTrainedModel):
        return model
    outermost = []
    for path, module in model.named_modules():
        if isinstance(module, PreTrainedModel) and not any(path.startswith(p + ".") for p, _ in outermost):
            outermost.append((path, module))
    if len(outermost) != 1:
        found = [p for p, _ in outermost] or "none"
        raise ValueError(
            f"export_tier needs one Hugging Face PreTrainedModel; {type(model).__name__} contains {found}. Pass the "
            "HF model itself (e.g. export_tier(module.model, ...))."
        )
    return outermost[0][1]


def export_tier(
    model: nn.Module,
    tier: int | None,
    path: str | os.PathLike[str],
    tokenizer: Any | None = None,
    widths: Sequence[int] | None = None,
) -> Path:
    """Write tier ``tier`` of ``model`` as a standard HF checkpoint directory; the caller's model is not changed.

    Works on a copy in which only the FFN prefixes are copied (the full FFN weights are never duplicated). Tied
    embeddings stay tied. An already sliced model (e.g. loaded from a tier checkpoint) is accepted: ``tier`` is
    relative to its recorded full size and may only go down in width.

    Args:
        model: An HF ``PreTrainedModel`` with FFNs of a registered family, or a module holding exactly one.
        tier: Tier to export (``h >> tier`` units per FFN); ``None`` when ``widths`` is given.
        path: Output directory (created).
        tokenizer: Saved next to the weights when given (anything with ``save_pretrained``).
        widths: Per-FFN widths. They must all be equal: the supported families' configs hold one FFN size for every
            layer, so a per-layer checkpoint could not be loaded by plain transformers.

    Returns:
        The output directory.

    Raises:
        ValueError: non-uniform ``widths``, an invalid tier, or no single HF model in ``model``.
    """
    pretrained = _find_pretrained_model(model)
    intermediate_size_field(pretrained.config)  # fail early, naming the known model types, if export cannot work
    blocks = find_ffns(pretrained)
    targets = resolve_widths(blocks, tier, widths)
    if len(set(targets)) != 1:
        field = intermediate_size_field(pretrained.config)
        raise ValueError(
            f"{type(pretrained).__name__} keeps one FFN size for all layers (config.{field}), so per-layer widths "
            f"{list(targets)} have no standard checkpoint in transformers. Export a uniform tier, or save the full "
            "model and apply slice_model(model, widths=...) after loading."
        )
    # Deep-copy with the FFN parameters pre-sliced through the memo, so the copy never holds full FFN weights.
    memo: dict[int, Any] = {}
    params = dict(pretrained.named_parameters())
    for block, width in zip(blocks, targets, strict=True):
        for spec in block.parameters:
            param = params[spec.name]
            if param.shape[spec.axis] != width:
                memo[id(param)] = nn.Parameter(
                    param.detach().narrow(spec.axis, 0, width).clone(), requires_grad=param.requires_grad
                )
    sliced = copy.deepcopy(pretrained, memo)
    apply_widths(sliced, blocks, targets)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with _quiet_progress_bars():
        sliced.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    return out


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' (and the hub's) progress bars, e.g. "Writing model shards", then restore the caller's."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    transformers_bars = hf_logging.is_progress_bar_enabled()
    hub_bars = not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # disables the hub's bars too
    try:
        yield
    finally:
        if transformers_bars:
            hf_logging.enable_progress_bar()  # enables the hub's bars too
        if hub_bars:
            enable_progress_bars()
        else:
            disable_progress_bars()
