"""Layerwise (DGL) adapters: ``trainer.LayerwiseStrategy`` and ``fabric.LayerwiseStrategy``."""
