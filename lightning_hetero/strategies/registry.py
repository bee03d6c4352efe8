"""Register lightning-hetero strategy names in the Trainer and Fabric registries, lazily.

Lightning 2.6 has no entry-point discovery for strategies, and the Trainer's ``StrategyRegistry`` and Fabric's
``STRATEGY_REGISTRY`` are two separate dicts. ``import lightning_hetero`` must stay cheap (it imports neither Lightning
nor transformers), so it calls :func:`register_when_lightning_loads`: the names of :data:`BUILTIN_STRATEGIES` are
registered at once if Lightning's registry modules are already imported, otherwise right after they are (a
post-import hook on ``lightning.pytorch.strategies`` and ``lightning.fabric.strategies``). Each entry is a
:class:`LazyStrategyClass` that imports the strategy's module only when the name is used. Registration is idempotent
(re-importing, or importing under ``__main__`` and again under the package name, must not raise "already present in
the registry"). The Trainer lower-cases string flags, so names must be lowercase.

A strategy joins by adding one :class:`StrategySpec` to ``_STRATEGIES`` (the import paths of its Trainer and Fabric
classes, of its settings and of its own callbacks): everything else is derived from that entry, namely its
``_spawn`` alias, its names in both registries, the lazy attributes ``lightning_hetero.<Class>``,
``lightning_hetero.fabric.<Class>`` and ``<Settings>`` (:data:`SETTINGS_CLASSES`), the short class names of the
``lightning-hetero`` command (strategies, settings and callbacks: :func:`import_cli_classes`) and the names its
typo check suggests (:func:`unknown_strategy_message`). Users register their own classes with
:func:`register_strategy`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.abc
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
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
    settings_class: str | None = None
    """Import path of the strategy's typed settings (``lightning_hetero.<Settings>``), or None if it has none."""
    callbacks: str | None = None
    """The module of the callbacks that serve this strategy's method only (its public import path; the CLI imports it
    so that YAML names them by short class name), or None if it has none."""


def spawn_alias(spec: StrategySpec) -> StrategySpec:
    """The ``<name>_spawn`` entry of ``spec``: the same classes with ``start_method="spawn"`` bound."""
    return StrategySpec(
        f"{spec.name}_spawn",
        spec.trainer_class,
        spec.fabric_class,
        description=f"{spec.description} (start_method='spawn')",
        init_params={**spec.init_params, "start_method": "spawn"},
        settings_class=spec.settings_class,
        callbacks=spec.callbacks,
    )


_STRATEGIES = (
    StrategySpec(
        "matformer",
        "lightning_hetero.strategies.matformer.trainer:MatFormerStrategy",
        "lightning_hetero.strategies.matformer.fabric:MatFormerStrategy",
        description="Tiered MatFormer DDP: each rank trains its own FFN prefix, gradients synced per region",
        settings_class="lightning_hetero.matformer.settings:MatFormerSettings",
        callbacks="lightning_hetero.strategies.matformer.callbacks",
    ),
    StrategySpec(
        "flexdemo",
        "lightning_hetero.strategies.flexdemo.trainer:FlexDeMoStrategy",
        "lightning_hetero.strategies.flexdemo.fabric:FlexDeMoStrategy",
        description="FlexDeMo: FSDP2 inside a node, compressed decoupled-momentum replication between nodes",
        settings_class="lightning_hetero.flexdemo.settings:FlexDeMoSettings",
    ),
    StrategySpec(
        "subspace_pipeline",
        "lightning_hetero.strategies.subspace_pipeline.trainer:SubspacePipelineStrategy",
        "lightning_hetero.strategies.subspace_pipeline.fabric:SubspacePipelineStrategy",
        description="Pipeline parallelism whose stage boundaries carry k numbers per token (subspace networks)",
        settings_class="lightning_hetero.subspace_pipeline.settings:SubspacePipelineSettings",
        callbacks="lightning_hetero.strategies.subspace_pipeline.callbacks",
    ),
    StrategySpec(
        "sparseflip",
        "lightning_hetero.strategies.sparseflip.trainer:SparseFlipStrategy",
        "lightning_hetero.strategies.sparseflip.fabric:SparseFlipStrategy",
        description="Ternary/binary weights trained by flips; ranks exchange thresholded sparse code gradients",
        settings_class="lightning_hetero.sparseflip.settings:SparseFlipSettings",
    ),
    StrategySpec(
        "layerwise",
        "lightning_hetero.strategies.layerwise.trainer:LayerwiseStrategy",
        "lightning_hetero.strategies.layerwise.fabric:LayerwiseStrategy",
        description="Decoupled greedy layerwise training (DGL): one block per stage, local losses, forward-only",
        settings_class="lightning_hetero.layerwise.settings:LayerwiseSettings",
        callbacks="lightning_hetero.strategies.layerwise.callbacks",
    ),
)

BUILTIN_STRATEGIES: list[StrategySpec] = [entry for spec in _STRATEGIES for entry in (spec, spawn_alias(spec))]
"""Strategies shipped by this package, each followed by its ``_spawn`` alias: the one table that the registries,
``lightning_hetero.<Class>``, ``lightning_hetero.fabric.<Class>``, the settings attributes, the CLI's short class names
and the typo check's list of names are derived from (read at each use, so a spec added here is seen everywhere)."""


SHARED_SETTINGS_CLASSES: dict[str, str] = {"ReplicationSettings": "lightning_hetero.replication.settings"}
"""Settings that several strategies embed (not a strategy's own), exported next to the strategies' settings."""


def _split(path: str) -> tuple[str, str]:
    """``"package.module:Class"`` -> ``("Class", "package.module")``."""
    module, _, name = path.partition(":")
    return name, module


def exported_classes(fabric: bool) -> dict[str, str]:
    """Class name -> module of every built-in Trainer (or Fabric) strategy class, for the packages' lazy attributes."""
    classes: dict[str, str] = {}
    for spec in BUILTIN_STRATEGIES:
        path = spec.fabric_class if fabric else spec.trainer_class
        if path:
            classes.setdefault(*_split(path))
    return classes


def settings_classes() -> dict[str, str]:
    """Class name -> module of every typed settings class: each strategy's own, then the shared ones."""
    classes = dict(_split(spec.settings_class) for spec in BUILTIN_STRATEGIES if spec.settings_class)
    return {**classes, **SHARED_SETTINGS_CLASSES}


SETTINGS_CLASSES: dict[str, str] = settings_classes()
"""Class name -> module of the typed settings (one per strategy, from ``_STRATEGIES``, plus the shared ones):
``from lightning_hetero import FlexDeMoSettings`` (and from :mod:`lightning_hetero.fabric`), loaded on first access.
They take the same settings in the Trainer and in Fabric."""


def exported_names(fabric: bool) -> list[str]:
    """Every lazy attribute of ``lightning_hetero`` (or ``lightning_hetero.fabric``): strategy and settings classes."""
    return [*exported_classes(fabric), *settings_classes()]


def lazy_class(name: str, fabric: bool, owner: str) -> type:
    """The built-in strategy or settings class ``name`` (imported now), for a package ``__getattr__``.

    Raises:
        AttributeError: ``name`` is no built-in strategy class of that kind nor a settings class (as a missing module
            attribute would).
    """
    module = exported_classes(fabric).get(name) or settings_classes().get(name)
    if module is None:
        raise AttributeError(f"module {owner!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def import_cli_classes() -> list[type]:
    """Import every built-in Trainer strategy class, settings class and strategy callbacks module, and return the
    strategy and settings classes (for the CLI, whose YAML names them and the callbacks by short class name:
    jsonargparse finds a class by name among the subclasses imported so far)."""
    names = [*exported_classes(fabric=False), *settings_classes()]
    classes = [lazy_class(name, fabric=False, owner=__name__) for name in names]
    for module in dict.fromkeys(spec.callbacks for spec in BUILTIN_STRATEGIES if spec.callbacks):
        importlib.import_module(module)
    return classes


def unknown_strategy_message(name: str, registered: Iterable[str]) -> str | None:
    """The message for a strategy name that is not registered (None when ``name`` is registered, or ``"auto"``).

    Lists our names (without their ``_spawn`` aliases) and suggests the closest registered name, ours or Lightning's.

    Args:
        name: The name given (``Trainer(strategy=...)``, ``strategy:`` in YAML, ``--trainer.strategy``).
        registered: The names the registry knows (``StrategyRegistry.available_strategies()``).
    """
    key, names = name.lower(), list(registered)
    if key == "auto" or key in names:
        return None
    specs = [spec for spec in BUILTIN_STRATEGIES if not spec.name.endswith("_spawn")]
    ours = [spec.name for spec in specs]
    by_class = {_split(spec.trainer_class)[0].lower(): spec.name for spec in specs if spec.trainer_class}
    close = [by_class[key]] if key in by_class else []  # a class name where a name goes ("FlexDeMoStrategy")
    close = close or difflib.get_close_matches(key, [*ours, *(n for n in names if n not in ours)], n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"strategy={name!r} is not a registered strategy name.{hint}\n"
        f"  lightning-hetero strategies: {', '.join(ours)} (each also as <name>_spawn).\n"
        "  Lightning's own: auto, ddp, ddp_spawn, fsdp, deepspeed, ... (StrategyRegistry.available_strategies()).\n"
        "  A class works too: `strategy: {class_path: FlexDeMoStrategy, init_args: {settings: {...}}}`."
    )


TRAINER_REGISTRY_MODULE = "lightning.pytorch.strategies"
FABRIC_REGISTRY_MODULE = "lightning.fabric.strategies"


def import_class(path: str) -> type:
    """The class at ``"package.module:Class"``."""
    module_name, _, class_name = path.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


class LazyStrategyClass:
    """Stands in for a strategy class in Lightning's registries: imports it when the registered name is used.

    Lightning's registries only call the entry (``entry(**init_params)``), so the strategy's module, and with it
    transformers, is imported on first use rather than when the names are registered.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def resolve(self) -> type:
        """The strategy class."""
        return import_class(self.path)

    def __call__(self, **init_params: Any) -> Any:
        return self.resolve()(**init_params)

    def __repr__(self) -> str:
        return f"LazyStrategyClass({self.path!r})"


def _identity(entry: Any) -> str:
    if isinstance(entry, LazyStrategyClass):
        return entry.path
    return f"{entry.__module__}:{entry.__qualname__}"


def _register_one(registry: dict, name: str, cls: Any, description: str, init_params: dict[str, Any]) -> None:
    existing = dict.get(registry, name)  # the registry's own get() instantiates the strategy
    if existing is not None:
        old, new = _identity(existing["strategy"]), _identity(cls)
        if old == new and existing["init_params"] == init_params:
            return  # idempotent: the same class under the same name
        same_class = old.partition(":")[2] == new.partition(":")[2] and old.partition(":")[0] in (
            new.partition(":")[0],
            "__main__",
        )
        if not same_class:
            raise ValueError(
                f"Strategy name {name!r} is already registered for {old.replace(':', '.')}; refusing to overwrite it "
                f"with {new.replace(':', '.')}. Pick another name."
            )
    registry.register(name, cls, description=description, override=True, **init_params)


def register_strategy(
    name: str,
    trainer_class: type | None = None,
    fabric_class: type | None = None,
    description: str = "",
    **init_params: Any,
) -> None:
    """Register ``name`` for a Trainer and/or Fabric strategy class, idempotently (imports Lightning).

    Args:
        name: Lowercase strategy name.
        trainer_class: Subclass of ``lightning.pytorch.strategies.Strategy`` or None.
        fabric_class: Subclass of ``lightning.fabric.strategies.Strategy`` or None.
        description: Free text stored in the registries.
        **init_params: Constructor arguments bound to the name.

    Raises:
        ValueError: ``name`` is not lowercase, or is already taken by a different class.
    """
    if not name or name != name.lower():
        raise ValueError(f"Strategy name {name!r} must be non-empty and lowercase (the Trainer lower-cases flags).")
    if trainer_class is None and fabric_class is None:
        raise ValueError(f"register_strategy({name!r}) needs a trainer_class, a fabric_class or both.")
    if trainer_class is not None:
        registry = importlib.import_module(TRAINER_REGISTRY_MODULE).StrategyRegistry
        _register_one(registry, name, trainer_class, description, init_params)
    if fabric_class is not None:
        registry = importlib.import_module(FABRIC_REGISTRY_MODULE).STRATEGY_REGISTRY
        _register_one(registry, name, fabric_class, description, init_params)


def _register_builtins_in(registry: dict, fabric: bool) -> None:
    for spec in BUILTIN_STRATEGIES:
        path = spec.fabric_class if fabric else spec.trainer_class
        if path:
            _register_one(registry, spec.name, LazyStrategyClass(path), spec.description, dict(spec.init_params))


def _register_trainer_builtins(module: ModuleType) -> None:
    _register_builtins_in(module.StrategyRegistry, fabric=False)


def _register_fabric_builtins(module: ModuleType) -> None:
    _register_builtins_in(module.STRATEGY_REGISTRY, fabric=True)


def register_builtin_strategies() -> list[str]:
    """Register every :data:`BUILTIN_STRATEGIES` entry in both registries now (imports Lightning, not our modules)."""
    _register_trainer_builtins(importlib.import_module(TRAINER_REGISTRY_MODULE))
    _register_fabric_builtins(importlib.import_module(FABRIC_REGISTRY_MODULE))
    return [spec.name for spec in BUILTIN_STRATEGIES]


def register_when_lightning_loads() -> None:
    """Register the built-in names in each registry now if Lightning loaded it, else as soon as it loads."""
    pending: dict[str, Callable[[ModuleType], None]] = {}
    for module_name, register in (
        (TRAINER_REGISTRY_MODULE, _register_trainer_builtins),
        (FABRIC_REGISTRY_MODULE, _register_fabric_builtins),
    ):
        module = sys.modules.get(module_name)
        if module is not None:
            register(module)
        else:
            pending[module_name] = register
    if pending and not any(isinstance(finder, _PostImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook(pending))


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs a callback right after each target module is executed (then removes itself when all have run)."""

    def __init__(self, callbacks: dict[str, Callable[[ModuleType], None]]) -> None:
        self._callbacks = dict(callbacks)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        callback = self._callbacks.get(fullname)
        if callback is None:
            return None
        for finder in sys.meta_path:  # the spec the import system would find without us
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return None
        spec.loader = _CallbackLoader(spec.loader, lambda module: self._fire(fullname, module))
        return spec

    def _fire(self, fullname: str, module: ModuleType) -> None:
        callback = self._callbacks.pop(fullname, None)
        if not self._callbacks and self in sys.meta_path:
            sys.meta_path.remove(self)
        if callback is not None:
            callback(module)


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader and calls ``callback(module)`` once the module has executed."""

    def __init__(self, loader: Any, callback: Callable[[ModuleType], None]) -> None:
        self._loader, self._callback = loader, callback

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_source, ...
        return getattr(self._loader, name)
