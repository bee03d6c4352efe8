"""The ``sparseflip`` adapters: ``trainer.SparseFlipStrategy`` (Trainer) and ``fabric.SparseFlipStrategy``."""
