"""Per-tier export: :class:`TierExport` writes one standard Hugging Face checkpoint per tier when ``fit`` ends.

Only global rank 0 exports; under a tiered strategy it is the rank that holds the full (tier-0) model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_hetero.matformer.adapters import find_ffns
from lightning_hetero.matformer.export import export_tier
from lightning_hetero.strategies.matformer.callbacks.tier_common import check_tiers_fit, find_hf_model, validate_tiers
from lightning_hetero.strategies.matformer.callbacks.tier_source import callback_tiers

__all__ = ["TierExport"]


class TierExport(Callback):
    """When ``fit`` ends, write each tier as a standard Hugging Face checkpoint under ``dirpath/tier{t}``.

    The HF model is ``pl_module.model`` when it is a ``PreTrainedModel``, else the first ``PreTrainedModel``
    submodule. Each directory is what ``export_tier`` writes (``model.safetensors``, ``config.json`` with the
    reduced FFN size, ``generation_config.json``), plus the datamodule's ``tokenizer`` when it has one and
    ``save_tokenizer`` is True; plain ``AutoModel*.from_pretrained(dirpath/tier{t})`` loads it. The paths are printed
    (rank-zero info) and kept in ``exported`` (tier -> path).

    Only global rank 0 exports: under a tiered strategy it is the rank holding the full (tier-0) model, and under
    data parallelism every rank holds the same weights. The model is checked when fit starts (an HF model is found,
    its FFNs support every tier, the parameters are not sharded DTensors), so a bad setup fails before training.
    Nothing is exported when fit fails.

    Args:
        dirpath: Output root; ``tier{t}`` subdirectories are created (files in them are overwritten).
        tiers: Tiers to export. None: the tiers the run trains, read at setup: ``MatFormerStrategy``'s
            ``settings.tiers`` (given tiers must include them there), else a ``MatFormerSampler``'s tiers (with neither,
            pass them). The tiers used are in ``resolved_tiers``.
        save_tokenizer: Also save ``trainer.datamodule.tokenizer`` (when present) into every tier directory.
    """

    def __init__(self, dirpath: str, tiers: list[int] | None = None, save_tokenizer: bool = True) -> None:
        if not isinstance(dirpath, (str, os.PathLike)) or not str(dirpath).strip():
            raise ValueError(f"TierExport(dirpath={dirpath!r}): pass an output directory, e.g. 'outputs/tiers'.")
        if not isinstance(save_tokenizer, bool):
            raise ValueError(f"TierExport(save_tokenizer={save_tokenizer!r}): use True or False.")
        self.dirpath = Path(dirpath)
        self.tiers = None if tiers is None else validate_tiers("TierExport", tiers)
        self.resolved_tiers: list[int] | None = None
        """The tiers exported in this fit (``tiers``, or the run's), from ``setup`` on."""
        self.save_tokenizer = save_tokenizer
        self.exported: dict[int, Path] = {}

    def resolve_tiers(self, trainer: Trainer) -> list[int]:
        """The tiers to export in this run (``tiers``, or the run's; see :func:`callback_tiers`)."""
        self.resolved_tiers = callback_tiers("TierExport", self.tiers, trainer)
        return list(self.resolved_tiers)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # every rank, so that a missing or mismatched tier list stops all of them
            self.resolve_tiers(trainer)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.resolve_tiers(trainer)  # again: with tiers: auto the strategy chose them in between (at its setup)
        if not trainer.is_global_zero:
            return
        model = find_hf_model(pl_module, "TierExport")
        sharded = [name for name, param in model.named_parameters() if type(param).__name__ == "DTensor"]
        if sharded:
            raise RuntimeError(
                f"TierExport needs the full weights on global rank 0, but {len(sharded)} parameters (e.g. "
                f"{sharded[0]}) are sharded DTensors under {type(trainer.strategy).__name__}. Export from a "
                "consolidated checkpoint with lightning_hetero.matformer.export.export_tier instead."
            )
        tiers = self.resolved_tiers if self.resolved_tiers is not None else self.resolve_tiers(trainer)
        check_tiers_fit("TierExport", model, tiers)

    def _tokenizer(self, trainer: Trainer) -> Any | None:
        if not self.save_tokenizer or trainer.datamodule is None:
            return None
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
            rank_zero_warn(
                f"TierExport: the datamodule's tokenizer ({type(tokenizer).__name__}) has no "
                "save_pretrained; exporting without it."
            )
            return None
        return tokenizer

    def export(self, trainer: Trainer, pl_module: LightningModule) -> dict[int, Path]:
        """Export every tier now (what ``on_fit_end`` does on global rank 0) and return tier -> directory."""
        model = find_hf_model(pl_module, "TierExport")
        tiers = self.resolved_tiers if self.resolved_tiers is not None else self.resolve_tiers(trainer)
        tokenizer = self._tokenizer(trainer)
        blocks = find_ffns(model)
        params = dict(model.named_parameters())
        total = sum(param.numel() for param in {id(p): p for p in model.parameters()}.values())
        for tier in tiers:
            path = export_tier(model, tier, self.dirpath / f"tier{tier}", tokenizer=tokenizer)
            removed = 0
            for block in blocks:
                width = block.full_size >> tier
                for spec in block.parameters:
                    param = params[spec.name]
                    removed += param.numel() // param.shape[spec.axis] * (param.shape[spec.axis] - width)
            self.exported[tier] = path
            rank_zero_info(
                f"[TierExport] tier {tier} (FFN width {blocks[0].full_size >> tier}, {total - removed:,} parameters) "
                f"-> {path}"
            )
        return dict(self.exported)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            self.export(trainer, pl_module)
