"""FlexDeMo's Lightning adapters: :class:`trainer.FlexDeMoStrategy` (Trainer) and :class:`fabric.FlexDeMoStrategy`."""
