"""``SubspaceDenseExport``: write the trained subspace pipeline as one plain HF checkpoint when ``fit`` ends."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["SubspaceDenseExport"]


class SubspaceDenseExport(Callback):
    """Write the trained pipeline as one plain HF checkpoint when ``fit`` ends (every rank joins; rank 0 writes).

    ``transformers.AutoModelForCausalLM.from_pretrained(dirpath)`` then loads a standard model (U folded into the
    weights, T_fixed added to the embedding) whose logits equal the pipeline's.

    Args:
        dirpath: Output directory.
        save_tokenizer: Also save ``trainer.datamodule.tokenizer`` when the datamodule has one.
    """

    def __init__(self, dirpath: str, save_tokenizer: bool = True) -> None:
        self.dirpath = str(dirpath)
        self.save_tokenizer = bool(save_tokenizer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_hetero.strategies.subspace.trainer import SubspacePipelineStrategy  # its users import it anyway

        strategy = trainer.strategy
        if not isinstance(strategy, SubspacePipelineStrategy):
            name = type(strategy).__name__
            raise TypeError(f"SubspaceDenseExport needs Trainer(strategy=SubspacePipelineStrategy(...)), got {name}.")
        datamodule = getattr(trainer, "datamodule", None)
        tokenizer = getattr(datamodule, "tokenizer", None) if self.save_tokenizer else None
        path = strategy.export_dense(self.dirpath, tokenizer=tokenizer)
        if path is not None:
            print(f"SubspaceDenseExport: plain HF checkpoint written to {path}")
