"""Subspace pipeline's Lightning adapters: :class:`trainer.SubspacePipelineStrategy` and :class:`fabric.SubspacePipelineStrategy`."""
