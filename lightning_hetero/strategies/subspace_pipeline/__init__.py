"""Subspace pipeline adapters: ``trainer.SubspacePipelineStrategy`` and ``fabric.SubspacePipelineStrategy``."""
