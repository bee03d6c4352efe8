"""Offline DataModules built with ``datasets``: Shakespeare (causal LM), gettext messages (translation), digits.

Every DataModule exposes ``hf_config_overrides()`` with the HF config fields the reference LightningModules set in
``configure_model``; text DataModules also expose ``tokenizer`` and ``vocab_size``. See ``docs/data.md``.
"""

from lightning_hetero.data.images import DigitsDataModule, MNISTDataModule
from lightning_hetero.data.shakespeare import ShakespeareDataModule
from lightning_hetero.data.translation import TranslationDataModule

__all__ = ["DigitsDataModule", "MNISTDataModule", "ShakespeareDataModule", "TranslationDataModule"]
