"""Register lightning-hetero strategy names in the Trainer and Fabric registries.

Lightning 2.6 has no entry-point discovery for strategies, and the Trainer's ``StrategyRegistry`` and Fabric's
``STRATEGY_REGISTRY`` are two separate dicts. Importing :mod:`lightning_hetero` therefore registers every name listed
in :data:`BUILTIN_STRATEGIES` in both, idempotently (re-importing, or importing under ``__main__`` and again under the
package name, must not raise "already present in the registry"). The Trainer lower-cases string flags, so names
must be lowercase.

A strategy joins by appending a :class:`StrategySpec` to :data:`BUILTIN_STRATEGIES` with the import paths of its
Trainer and Fabric classes; the classes are imported lazily at registration time.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StrategySpec:
    """One registered strategy name and the classes it resolves to."""

    name: str
    """Lowercase name usable as ``Trainer(strategy=name)``, ``Fabric(strategy=name)`` or ``strategy: name`` in YAML."""
    trainer_class: str | None
    """Import path ``"package.module:Class"`` of the Trainer strategy, or None if there is none."""
    fabric_class: str | None
    """Import path of the Fabric strategy, or None if there is none."""
    description: str = ""
    """One line shown by ``StrategyRegistry.available_strategies()`` consumers."""
    init_params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to the name (e.g. ``{"start_method": "spawn"}`` for a ``*_spawn`` alias)."""


#: Strategies shipped by this package. Each strategy appends its own spec(s) when it lands.
BUILTIN_STRATEGIES: list[StrategySpec] = []

BUILTIN_STRATEGIES.extend(
    [
        StrategySpec(
            "matformer",
            "lightning_hetero.matformer.strategy:MatFormerStrategy",
            "lightning_hetero.matformer.fabric:MatFormerStrategy",
            description="Tiered MatFormer DDP: each rank trains its own FFN prefix, gradients synced per region",
        ),
        StrategySpec(
            "matformer_spawn",
            "lightning_hetero.matformer.strategy:MatFormerStrategy",
            "lightning_hetero.matformer.fabric:MatFormerStrategy",
            description="Tiered MatFormer DDP with start_method='spawn'",
            init_params={"start_method": "spawn"},
        ),
        StrategySpec(
            "flexdemo",
            "lightning_hetero.flexdemo.strategy:FlexDeMoStrategy",
            "lightning_hetero.flexdemo.fabric:FlexDeMoStrategy",
            description="FlexDeMo: FSDP2 inside a node, compressed decoupled-momentum replication between nodes",
        ),
        StrategySpec(
            "flexdemo_spawn",
            "lightning_hetero.flexdemo.strategy:FlexDeMoStrategy",
            "lightning_hetero.flexdemo.fabric:FlexDeMoStrategy",
            description="FlexDeMo with start_method='spawn'",
            init_params={"start_method": "spawn"},
        ),
        StrategySpec(
            "subspace_pipeline",
            "lightning_hetero.subspace.strategy:SubspacePipelineStrategy",
            "lightning_hetero.subspace.fabric:SubspacePipelineStrategy",
            description="Pipeline parallelism whose stage boundaries carry k numbers per token (subspace networks)",
        ),
        StrategySpec(
            "subspace_pipeline_spawn",
            "lightning_hetero.subspace.strategy:SubspacePipelineStrategy",
            "lightning_hetero.subspace.fabric:SubspacePipelineStrategy",
            description="Subspace pipeline with start_method='spawn'",
            init_params={"start_method": "spawn"},
        ),
    ]
)


def _import_class(path: str) -> type:
    module_name, _, class_name = path.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _register_one(registry: dict, name: str, cls: type, description: str, init_params: dict[str, Any]) -> None:
    existing = dict.get(registry, name)  # the registry's own get() instantiates the strategy
    if existing is not None:
        if existing["strategy"] is cls and existing["init_params"] == init_params:
            return  # idempotent: the same class under the same name
        if existing["strategy"].__qualname__ == cls.__qualname__ and existing["strategy"].__module__ in (
            cls.__module__,
            "__main__",
        ):
            pass  # the same class imported twice (e.g. once as __main__): replace silently
        else:
            raise ValueError(
                f"Strategy name {name!r} is already registered for {existing['strategy'].__module__}."
                f"{existing['strategy'].__qualname__}; refusing to overwrite it with "
                f"{cls.__module__}.{cls.__qualname__}. Pick another name."
            )
    registry.register(name, cls, description=description, override=True, **init_params)


def register_strategy(
    name: str,
    trainer_class: type | None = None,
    fabric_class: type | None = None,
    description: str = "",
    **init_params: Any,
) -> None:
    """Register ``name`` for a Trainer and/or Fabric strategy class, idempotently.

    Args:
        name: Lowercase strategy name.
        trainer_class: Subclass of ``lightning.pytorch.strategies.Strategy`` or None.
        fabric_class: Subclass of ``lightning.fabric.strategies.Strategy`` or None.
        description: Free text stored in the registries.
        **init_params: Constructor arguments bound to the name.

    Raises:
        ValueError: ``name`` is not lowercase, or is already taken by a different class.
    """
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry as TRAINER_REGISTRY

    if not name or name != name.lower():
        raise ValueError(f"Strategy name {name!r} must be non-empty and lowercase (the Trainer lower-cases flags).")
    if trainer_class is None and fabric_class is None:
        raise ValueError(f"register_strategy({name!r}) needs a trainer_class, a fabric_class or both.")
    if trainer_class is not None:
        _register_one(TRAINER_REGISTRY, name, trainer_class, description, init_params)
    if fabric_class is not None:
        _register_one(FABRIC_REGISTRY, name, fabric_class, description, init_params)


def register_builtin_strategies() -> list[str]:
    """Register every :data:`BUILTIN_STRATEGIES` entry in both registries; returns the names registered."""
    for spec in BUILTIN_STRATEGIES:
        register_strategy(
            spec.name,
            trainer_class=_import_class(spec.trainer_class) if spec.trainer_class else None,
            fabric_class=_import_class(spec.fabric_class) if spec.fabric_class else None,
            description=spec.description,
            **spec.init_params,
        )
    return [spec.name for spec in BUILTIN_STRATEGIES]
