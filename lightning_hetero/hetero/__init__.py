"""Measured heterogeneity: what each rank measures about itself at fit start, and the pure rules that turn the
gathered measurements into a per-rank choice (MatFormer ``tiers: auto``, batch shares).

Framework-free (torch only) and imports no method package: a shared floor (docs/architecture.md).
"""
