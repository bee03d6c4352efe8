"""Model schema identity across MatFormer ranks: every rank must train tiers of the same tier-0 model.

Ranks legitimately differ in tier (a sliced checkpoint has a smaller FFN size field), dtype, the path they loaded
from, and runtime switches. ``canonical_schema`` removes those differences: it resets the FFN size field to the full
size (from ``matformer_base_intermediate_size`` when a config is sliced; GPT-2's ``n_inner=None`` becomes
``4 * n_embd``) and drops per-rank fields. ``schema_hash`` is the sha256 of its canonical JSON. The strategy
all-gathers the schemas and ``compare_schemas`` names the ranks and fields that differ.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.matformer.adapters import (
    BASE_SIZE_KEY,
    TIER_KEY,
    WIDTHS_KEY,
    UnsupportedModelError,
    default_intermediate_size,
    intermediate_size_field,
)

PER_RANK_FIELDS: frozenset[str] = frozenset(
    {
        # where and how a rank loaded the model
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "transformers_version",
        "architectures",
        "auto_map",
        # numerics / kernels, not the architecture
        "dtype",
        "torch_dtype",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        "attn_implementation",
        "_experts_implementation",
        # runtime switches of forward, not of the weights
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
        # the tier itself
        TIER_KEY,
        WIDTHS_KEY,
        BASE_SIZE_KEY,
    }
)
"""Config fields dropped from the canonical schema because ranks of one model may legitimately differ in them."""

_MISSING = "<missing>"


class SchemaMismatchError(RuntimeError):
    """Ranks hold configs of different tier-0 models.

    Attributes:
        reference_rank: The rank every other rank was compared with (the lowest).
        differences: rank -> field (dotted for nested configs) -> (value on that rank, value on the reference rank).
    """

    def __init__(self, message: str, reference_rank: int, differences: dict[int, dict[str, tuple[Any, Any]]]):
        super().__init__(message)
        self.reference_rank = reference_rank
        self.differences = differences


def _to_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a transformers PretrainedConfig or a dict, got {type(config).__name__}.")


def _drop_fields(value: Any, ignored: frozenset[str]) -> Any:
    # Recurse into sub-configs (encoder/decoder, text_config, ...) so their per-rank fields go too.
    if isinstance(value, Mapping):
        return {k: _drop_fields(v, ignored) for k, v in sorted(value.items()) if k not in ignored}
    if isinstance(value, (list, tuple)):
        return [_drop_fields(v, ignored) for v in value]
    return value


def canonical_schema(config: Any, ignore_fields: Iterable[str] = ()) -> dict[str, Any]:
    """The tier-0 config of a model, canonicalized so that every rank of the same model gets the same dict.

    Args:
        config: A ``PretrainedConfig`` (of a full or a sliced model) or its ``to_dict()``.
        ignore_fields: Extra top-level or nested field names that may differ between ranks.

    Returns:
        A JSON-serializable dict with keys sorted.

    Raises:
        ValueError: the config records a full size (``matformer_base_intermediate_size``) but its model type has no
            registered FFN size field.
    """
    data = _to_dict(config)
    try:
        field: str | None = intermediate_size_field(data)
    except UnsupportedModelError:
        if data.get(BASE_SIZE_KEY) is not None:
            raise ValueError(
                f"Config of model_type {data.get('model_type')!r} records {BASE_SIZE_KEY} but no FFN adapter names "
                "its size field; register_adapter(FFNAdapter(..., model_types=(...), size_field=...))."
            ) from None
        field = None
    if field is not None:
        if data.get(BASE_SIZE_KEY) is not None:
            data[field] = int(data[BASE_SIZE_KEY])
        elif data.get(field) is None:
            data[field] = default_intermediate_size(data)
    return _drop_fields(data, PER_RANK_FIELDS | frozenset(ignore_fields))


def module_schema(module: nn.Module) -> dict[str, Any]:
    """The canonical tier-0 schema of the HF model(s) in ``module``, or its parameter shapes if it holds none."""
    outermost: list[tuple[str, PreTrainedModel]] = []
    for path, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel) and not any(path.startswith(p + ".") for p, _ in outermost):
            outermost.append((path, sub))
    if len(outermost) == 1:
        return canonical_schema(outermost[0][1].config)
    if outermost:
        return {path or "<root>": canonical_schema(model.config) for path, model in outermost}
    return {"parameters": {name: list(p.shape) for name, p in module.named_parameters()}}


def schema_hash(config: Any, ignore_fields: Iterable[str] = ()) -> str:
    """sha256 (hex) of the canonical JSON of ``canonical_schema(config, ignore_fields)``."""
    return canonical_hash(canonical_schema(config, ignore_fields))


def canonical_hash(canonical: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of an already canonical schema (e.g. ``module_schema(module)``)."""
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


SETUP_DOCUMENT: dict[str, type | tuple[type, ...]] = {
    "error": (str, type(None)),
    "schema": (dict, type(None)),
    "schema_hash": (str, type(None)),
}
"""What every MatFormer rank sends at setup (checked by ``all_gather_json``): its error, schema and schema hash."""


def agree_on_schema(documents: Sequence[Mapping[str, Any]]) -> str:
    """The schema hash every rank agrees on, from every rank's setup document (rank order).

    A document whose hash is not the sha256 of the schema it carries is corrupt (:class:`PeerPayloadError`); ranks
    with different schemas raise :class:`SchemaMismatchError` naming the fields.
    """
    hashes = []
    for rank, document in enumerate(documents):
        schema, digest = document.get("schema"), document.get("schema_hash")
        if not isinstance(schema, Mapping) or not isinstance(digest, str) or canonical_hash(schema) != digest:
            raise PeerPayloadError(
                f"rank {rank} sent a schema hash {str(digest)[:16]!r}... that does not match the schema it sent;"
                " refusing its setup document (corrupt or hostile peer).",
                rank,
            )
        hashes.append(digest)
    if len(set(hashes)) > 1:
        compare_schemas({rank: document["schema"] for rank, document in enumerate(documents)})
        raise SchemaMismatchError(
            f"MatFormer ranks sent different schema hashes {sorted(set(hashes))} for schemas that compare equal.",
            0,
            {},
        )
    return hashes[0]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and (value or not prefix):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def compare_schemas(schemas_by_rank: Mapping[int, Mapping[str, Any]], max_fields: int = 10) -> None:
    """Raise if the canonical schemas of the ranks differ.

    Args:
        schemas_by_rank: rank -> ``canonical_schema(...)`` of that rank (e.g. from an all_gather_object).
        max_fields: Differing fields listed per rank in the message (all are kept in the exception's ``differences``).

    Raises:
        ValueError: ``schemas_by_rank`` is empty.
        SchemaMismatchError: some rank differs from the lowest rank; the message names each such rank and every
            differing field with both values.
    """
    if not schemas_by_rank:
        raise ValueError("schemas_by_rank is empty; pass {rank: canonical_schema(config)} for every rank.")
    reference_rank = min(schemas_by_rank)
    reference = _flatten(schemas_by_rank[reference_rank])
    differences: dict[int, dict[str, tuple[Any, Any]]] = {}
    for rank in sorted(schemas_by_rank):
        if rank == reference_rank:
            continue
        flat = _flatten(schemas_by_rank[rank])
        diff = {
            key: (flat.get(key, _MISSING), reference.get(key, _MISSING))
            for key in sorted(set(flat) | set(reference))
            if flat.get(key, _MISSING) != reference.get(key, _MISSING)
        }
        if diff:
            differences[rank] = diff
    if not differences:
        return
    lines = [
        f"MatFormer ranks hold different models: the canonical tier-0 config of rank(s) "
        f"{', '.join(map(str, differences))} differs from rank {reference_rank}."
    ]
    for rank, diff in differences.items():
        shown = [
            f"{key}: {ours!r} (rank {rank}) != {theirs!r} (rank {reference_rank})"
            for key, (ours, theirs) in diff.items()
        ]
        more = f"; ... and {len(shown) - max_fields} more" if len(shown) > max_fields else ""
        lines.append(f"  rank {rank}: " + "; ".join(shown[:max_fields]) + more)
    lines.append(
        "Every rank must load the same base model (tiers, dtype and load path may differ). Load the same "
        "checkpoint/config everywhere, or pass the fields that may legitimately differ as ignore_fields."
    )
    raise SchemaMismatchError("\n".join(lines), reference_rank, differences)
