"""MatFormer's Lightning adapters: ``trainer.MatFormerStrategy`` (Trainer) and ``fabric.MatFormerStrategy``."""
