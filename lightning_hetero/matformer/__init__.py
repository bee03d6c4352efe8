"""Tiered MatFormer training (work in progress): nested FFN prefixes of one shared model per rank.

Framework-free building blocks live here (FFN adapters, slicing and export, schema hashing, per-region gradient
aggregation); the Trainer/Fabric ``MatFormerStrategy`` will build on them.
"""
