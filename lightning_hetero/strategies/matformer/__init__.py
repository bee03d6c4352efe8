"""MatFormer's Lightning adapters: :class:`trainer.MatFormerStrategy` (Trainer) and :class:`fabric.MatFormerStrategy`."""
