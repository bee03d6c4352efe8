"""Reference LightningModules over Hugging Face models, and named model-size presets.

All three modules build their HF model in ``configure_model`` (so sharding strategies can build it in place) and
take their vocabulary / image geometry from the datamodule's ``hf_config_overrides()``; see ``docs/models.md``.
"""

from lightning_hetero.models.base import HFModuleBase
from lightning_hetero.models.causal_lm import CausalLMModule
from lightning_hetero.models.image_classifier import ImageClassifierModule
from lightning_hetero.models.presets import PRESETS, build_config
from lightning_hetero.models.seq2seq import Seq2SeqModule

__all__ = ["CausalLMModule", "HFModuleBase", "ImageClassifierModule", "PRESETS", "Seq2SeqModule", "build_config"]
