"""Hugging Face model discovery shared by the methods: :mod:`.decoder` finds a Llama-family causal LM and its parts.

Framework-free: torch and the HF model handed in, never Lightning or a method package.
"""
