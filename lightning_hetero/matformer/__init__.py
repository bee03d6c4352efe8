"""Tiered MatFormer training: nested FFN prefixes of one shared model, one width per rank.

:class:`MatFormerSettings` holds every setting, declared once. Framework-free building blocks (FFN adapters, slicing
and export, schema hashing, tier layouts and per-region gradient aggregation, checkpoint slicing) and the runtime the
strategies drive. The Lightning adapters live in
:mod:`lightning_hetero.strategies.matformer` (``lightning_hetero.MatFormerStrategy`` for the Trainer,
``lightning_hetero.fabric.MatFormerStrategy`` for Fabric). See ``docs/matformer.md`` and
``docs/matformer_aggregation.md``.
"""

from lightning_hetero.matformer.adapters import (
    FFNAdapter,
    FFNBlock,
    Projection,
    UnsupportedModelError,
    config_intermediate_size,
    ffn_parameters,
    find_ffns,
    register_adapter,
    registered_adapters,
    unregister_adapter,
)
from lightning_hetero.matformer.aggregate import aggregate_gradients
from lightning_hetero.matformer.checkpoint import grow_to_full, slice_model_state, slice_optimizer_state
from lightning_hetero.matformer.compressed import CompressedExchange, demo_bytes_per_step, demo_payload_bytes
from lightning_hetero.matformer.export import export_tier
from lightning_hetero.matformer.helper_ranks import HelperConfig, helper_neurons, trained_neurons
from lightning_hetero.matformer.layout import TierLayout, widths_for
from lightning_hetero.matformer.prefix_state import (
    embed_prefix,
    pad_prefix,
    prefix_state_dict,
    scatter_prefix_into_full,
)
from lightning_hetero.matformer.region_groups import RegionGroups
from lightning_hetero.matformer.regions import Region, regions
from lightning_hetero.matformer.runtime import MatFormerRuntime
from lightning_hetero.matformer.schema import SchemaMismatchError, canonical_schema, compare_schemas, schema_hash
from lightning_hetero.matformer.settings import MatFormerSettings
from lightning_hetero.matformer.slicing import mask_suffix_gradients, slice_model, tier_view
from lightning_hetero.matformer.tiers import bytes_per_step, contributor_counts
from lightning_hetero.matformer.types import FFNParameter, tier_width

__all__ = [
    "CompressedExchange",
    "FFNAdapter",
    "FFNBlock",
    "FFNParameter",
    "HelperConfig",
    "MatFormerRuntime",
    "MatFormerSettings",
    "Projection",
    "Region",
    "RegionGroups",
    "SchemaMismatchError",
    "TierLayout",
    "UnsupportedModelError",
    "aggregate_gradients",
    "bytes_per_step",
    "canonical_schema",
    "compare_schemas",
    "config_intermediate_size",
    "contributor_counts",
    "demo_bytes_per_step",
    "demo_payload_bytes",
    "embed_prefix",
    "export_tier",
    "ffn_parameters",
    "find_ffns",
    "grow_to_full",
    "helper_neurons",
    "mask_suffix_gradients",
    "pad_prefix",
    "prefix_state_dict",
    "register_adapter",
    "registered_adapters",
    "regions",
    "scatter_prefix_into_full",
    "schema_hash",
    "slice_model",
    "slice_model_state",
    "slice_optimizer_state",
    "tier_view",
    "tier_width",
    "trained_neurons",
    "unregister_adapter",
    "widths_for",
]
