"""One registry of FFN adapters: where the nested (MatFormer) FFN of each Hugging Face family lives.

An FFN maps the model width ``d`` to a hidden width ``h`` with one or more *input* projections (up, and gate for gated
activations) and back to ``d`` with one *output* projection (down). A tier keeps the prefix ``[0, w)`` of the hidden
axis, so the hidden axis of every input projection's weight and bias and of the output projection's weight is sliced,
while the output projection's bias (size ``d``) never is. Which weight axis is the hidden one depends on the layer type:
``nn.Linear`` stores ``[out, in]`` (inputs: axis 0, output: axis 1); GPT-2's ``Conv1D`` stores ``[in, out]`` (inputs:
axis 1, output: axis 0).

FFNs are discovered by module type (matched by class name anywhere in the module's MRO, so subclasses work) plus the
attribute structure the adapter names, inside any ``nn.Module`` (an HF base model, a model with a head, or a user's
LightningModule holding one). Nothing here needs our reference modules.

Example:
    >>> blocks = find_ffns(model)  # doctest: +SKIP
    >>> blocks[0].path, blocks[0].width, [p.name for p in blocks[0].parameters]  # doctest: +SKIP
    ('model.layers.0.mlp', 64, ['model.layers.0.mlp.gate_proj.weight', ...])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn
from transformers.pytorch_utils import Conv1D

from lightning_hetero.matformer.types import FFNParameter

BASE_SIZE_KEY = "matformer_base_intermediate_size"
"""Config attribute a sliced model records its full (tier-0) FFN size under."""
TIER_KEY = "matformer_tier"
"""Config attribute holding the tier a sliced model was cut to (absent for per-layer widths)."""
WIDTHS_KEY = "matformer_widths"
"""Config attribute holding the per-FFN widths of a Mix'n'Match slice (absent for a uniform tier)."""
FULL_SIZE_ATTR = "_matformer_full_size"
"""Attribute set on an FFN's root module once it is sliced, so its full size survives without a config."""


@dataclass(frozen=True)
class FFNAdapter:
    """How to find one kind of FFN block and where its hidden (intermediate) axis runs.

    Example (a hypothetical ``MyMLP`` with ``w_in``/``w_out`` ``nn.Linear`` children, config field ``ffn_dim``)::

        register_adapter(FFNAdapter(family="mine", module_types=("MyMLP",), inputs=("w_in",), output="w_out",
                                    model_types=("mine",), size_field="ffn_dim"))
    """

    family: str
    """Unique name of the adapter (e.g. ``"llama"``, ``"t5-gated"``)."""
    module_types: tuple[str, ...]
    """Class names of the FFN's root module; a module matches when one of them is in its class's MRO."""
    inputs: tuple[str, ...]
    """Dotted paths (relative to the root module) of the projections ``d -> h`` (up, gate). Their weights' hidden
    axis and their biases are sliced."""
    output: str
    """Dotted path of the projection ``h -> d`` (down). Its weight's hidden axis is sliced, its bias never."""
    model_types: tuple[str, ...] = ()
    """``config.model_type`` values whose config holds this FFN's size in ``size_field`` (for schema and export)."""
    size_field: str = "intermediate_size"
    """Config attribute holding the FFN size ``h``."""
    default_size: Callable[[Any], int] | None = None
    """FFN size when ``size_field`` is ``None`` in the config (GPT-2: ``4 * n_embd``)."""

    def __post_init__(self) -> None:
        if not self.family or not isinstance(self.family, str):
            raise ValueError("FFNAdapter.family must be a non-empty string, e.g. family='my-model'.")
        if not self.module_types or isinstance(self.module_types, str):
            raise ValueError(
                f"FFNAdapter {self.family!r}: module_types must be a tuple of class names, e.g. ('MyMLP',)."
            )
        if not self.inputs or isinstance(self.inputs, str):
            raise ValueError(f"FFNAdapter {self.family!r}: inputs must be a tuple of paths, e.g. ('up_proj',).")
        if not self.output or self.output in self.inputs:
            raise ValueError(f"FFNAdapter {self.family!r}: output must name the down projection, distinct from inputs.")
        if isinstance(self.model_types, str):
            raise ValueError(f"FFNAdapter {self.family!r}: model_types must be a tuple, e.g. ('llama',).")


@dataclass(frozen=True)
class Projection:
    """One projection of a discovered FFN."""

    path: str
    """Module path in the model (``model.get_submodule(path)``)."""
    role: Literal["input", "output"]
    """``"input"`` for ``d -> h`` (up, gate), ``"output"`` for ``h -> d`` (down)."""
    kind: Literal["linear", "conv1d"]
    """``nn.Linear`` (weight ``[out, in]``) or GPT-2 ``Conv1D`` (weight ``[in, out]``)."""
    weight_axis: int
    """Axis of the weight along the FFN hidden dimension."""
    has_bias: bool
    """Whether the module has a bias (sliced for inputs, kept whole for the output)."""


@dataclass(frozen=True)
class FFNBlock:
    """One FFN found in a model."""

    path: str
    """Module path of the FFN's root module (e.g. ``model.layers.3.mlp``; BERT: the layer, ``bert.encoder.layer.3``)."""
    layer: int
    """Ordinal of this FFN among all FFNs of the model in module order: the block index for single-stack models;
    T5 numbers encoder FFNs ``0..E-1`` then decoder FFNs ``E..E+D-1``. Per-layer widths are indexed by it."""
    family: str
    """Adapter family that matched."""
    width: int
    """Current hidden size (smaller than ``full_size`` when the model is already sliced)."""
    full_size: int
    """Hidden size ``h`` of the full (tier-0) model."""
    model_size: int
    """Model width ``d`` (input size of the input projections)."""
    projections: tuple[Projection, ...]
    """Input projections first, then the output projection."""
    parameters: tuple[FFNParameter, ...]
    """Every parameter with an axis along the hidden dimension (weights, input biases), named as in
    ``model.named_parameters()``."""


class UnsupportedModelError(ValueError):
    """No FFN of a registered family was found in a model."""


_ADAPTERS: dict[str, FFNAdapter] = {}


def register_adapter(adapter: FFNAdapter, *, replace: bool = False) -> FFNAdapter:
    """Add an adapter to the registry (for FFNs of a family we do not ship).

    Args:
        adapter: The adapter.
        replace: Replace an adapter of the same family instead of raising.

    Raises:
        ValueError: the family is already registered (pass ``replace=True``), or one of its ``model_types`` is already
            mapped to a different ``size_field``.
    """
    if adapter.family in _ADAPTERS and not replace:
        raise ValueError(
            f"An FFN adapter for family {adapter.family!r} is already registered; pass replace=True to replace it."
        )
    for other in _ADAPTERS.values():
        if other.family == adapter.family:
            continue
        for model_type in set(adapter.model_types) & set(other.model_types):
            if other.size_field != adapter.size_field:
                raise ValueError(
                    f"model_type {model_type!r} already keeps its FFN size in {other.size_field!r} (adapter "
                    f"{other.family!r}); adapter {adapter.family!r} says {adapter.size_field!r}. Use one size_field."
                )
    _ADAPTERS[adapter.family] = adapter
    return adapter


def unregister_adapter(family: str) -> FFNAdapter:
    """Remove and return the adapter of ``family``; raises ``KeyError`` naming the registered families if absent."""
    if family not in _ADAPTERS:
        raise KeyError(f"No FFN adapter {family!r}; registered: {sorted(_ADAPTERS)}.")
    return _ADAPTERS.pop(family)


def registered_adapters() -> dict[str, FFNAdapter]:
    """A copy of the registry, family -> adapter."""
    return dict(_ADAPTERS)


def _supported_text() -> str:
    return ", ".join(f"{a.family} ({'/'.join(a.module_types)})" for a in _ADAPTERS.values())


def _register_builtin() -> None:
    # Llama-style SwiGLU MLPs: gate and up are inputs, down the output. Only Llama exposes `mlp_bias`; the others
    # hard-code bias=False, and discovery reads the bias from the module, so one rule serves all five.
    for family, module_type in (
        ("llama", "LlamaMLP"),
        ("mistral", "MistralMLP"),
        ("qwen2", "Qwen2MLP"),
        ("qwen3", "Qwen3MLP"),
        ("olmo2", "Olmo2MLP"),
    ):
        register_adapter(
            FFNAdapter(family, (module_type,), ("gate_proj", "up_proj"), "down_proj", (family,), "intermediate_size")
        )
    register_adapter(
        FFNAdapter("gpt2", ("GPT2MLP",), ("c_fc",), "c_proj", ("gpt2",), "n_inner", default_size=lambda c: 4 * c.n_embd)
    )
    register_adapter(FFNAdapter("t5", ("T5DenseActDense",), ("wi",), "wo", ("t5",), "d_ff"))
    register_adapter(FFNAdapter("t5-gated", ("T5DenseGatedActDense",), ("wi_0", "wi_1"), "wo", ("t5",), "d_ff"))
    register_adapter(FFNAdapter("vit", ("ViTMLP",), ("fc1",), "fc2", ("vit",), "intermediate_size"))
    # transformers < 5 kept ViT's FFN as ViTLayer.intermediate.dense / .output.dense (5.x renamed it to ViTMLP).
    # In 5.x ViTLayer has no `intermediate`, so this adapter simply never matches there.
    register_adapter(
        FFNAdapter("vit-legacy", ("ViTLayer",), ("intermediate.dense",), "output.dense", ("vit",), "intermediate_size")
    )
    # BERT's FFN spans two sibling modules of the layer; `output.dense` relative to the layer is BertOutput's dense,
    # never the attention's `attention.output.dense`.
    register_adapter(
        FFNAdapter("bert", ("BertLayer",), ("intermediate.dense",), "output.dense", ("bert",), "intermediate_size")
    )


_register_builtin()


def _mro_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _hidden_and_model_dims(module: nn.Module, role: str) -> tuple[int, int, str, int] | None:
    """(hidden size, model size, kind, hidden weight axis) of a projection, or None if it is not a Linear/Conv1D."""
    if isinstance(module, Conv1D):
        n_in, n_out = module.weight.shape  # Conv1D is [in, out]
        if role == "input":
            return n_out, n_in, "conv1d", 1
        return n_in, n_out, "conv1d", 0
    if isinstance(module, nn.Linear):
        n_out, n_in = module.weight.shape
        if role == "input":
            return n_out, n_in, "linear", 0
        return n_in, n_out, "linear", 1
    return None


def _match(root: nn.Module, root_path: str, adapter: FFNAdapter) -> tuple[list[Projection], int, int] | None:
    """Projections, hidden width and model width of ``root`` under ``adapter``, or None if the structure differs."""
    roles = [(name, "input") for name in adapter.inputs] + [(adapter.output, "output")]
    found: list[tuple[str, str, nn.Module, tuple[int, int, str, int]]] = []
    for name, role in roles:
        module = _submodule(root, name)
        dims = None if module is None else _hidden_and_model_dims(module, role)
        if dims is None:
            return None
        found.append((name, role, module, dims))
    widths = {name: dims[0] for name, _, _, dims in found}
    model_sizes = {name: dims[1] for name, _, _, dims in found}
    if len(set(widths.values())) != 1 or len(set(model_sizes.values())) != 1:
        raise ValueError(
            f"FFN {root_path or '<root>'} ({type(root).__name__}, adapter {adapter.family!r}) has inconsistent "
            f"projection sizes: hidden widths {widths}, model widths {model_sizes}. It looks partially sliced; "
            "rebuild the model from a full or a consistently sliced checkpoint."
        )
    projections = [
        Projection(
            path=f"{root_path}.{name}" if root_path else name,
            role=role,  # type: ignore[arg-type]
            kind=dims[2],  # type: ignore[arg-type]
            weight_axis=dims[3],
            has_bias=getattr(module, "bias", None) is not None,
        )
        for name, role, module, dims in found
    ]
    return projections, next(iter(widths.values())), next(iter(model_sizes.values()))


def _recorded_full_size(model: nn.Module) -> int | None:
    """Full FFN size recorded in the config of an HF model inside ``model`` (set by slicing or a sliced export)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        value = getattr(config, BASE_SIZE_KEY, None) if config is not None else None
        if value is not None:
            return int(value)
    return None


def find_ffns(model: nn.Module) -> list[FFNBlock]:
    """Every FFN block of a registered family in ``model``, in module order.

    Args:
        model: Any module containing HF FFN blocks (a base model, a model with a head, a LightningModule, ...).

    Returns:
        One ``FFNBlock`` per FFN; ``layer`` is its ordinal. Parameter names are relative to ``model``.

    Raises:
        UnsupportedModelError: no FFN of a registered family is found (the message names the supported families and
            how to register an adapter).
        ValueError: an FFN's projections have inconsistent sizes (a partially sliced model).
    """
    recorded_full = _recorded_full_size(model)
    blocks: list[FFNBlock] = []
    claimed: str | None = (
        None  # the last matched root: named_modules is pre-order, so its descendants follow it directly
    )
    for path, module in model.named_modules():
        if claimed is not None and path.startswith(claimed):
            continue
        names = _mro_names(module)
        for adapter in _ADAPTERS.values():
            if names.isdisjoint(adapter.module_types):
                continue
            matched = _match(module, path, adapter)
            if matched is None:
                continue  # right class name, different structure (e.g. ViTLayer in transformers 5)
            projections, width, model_size = matched
            full_size = getattr(module, FULL_SIZE_ATTR, None) or recorded_full or width
            if full_size < width:
                raise ValueError(
                    f"FFN {path} is {width} wide but the recorded full size ({BASE_SIZE_KEY}) is {full_size}; "
                    "the config metadata does not match the weights. Remove the stale field from the config."
                )
            parameters = []
            for proj in projections:
                parameters.append(FFNParameter(f"{proj.path}.weight", proj.weight_axis, full_size, len(blocks)))
                if proj.role == "input" and proj.has_bias:
                    parameters.append(FFNParameter(f"{proj.path}.bias", 0, full_size, len(blocks)))
            blocks.append(
                FFNBlock(
                    path,
                    len(blocks),
                    adapter.family,
                    width,
                    full_size,
                    model_size,
                    tuple(projections),
                    tuple(parameters),
                )
            )
            claimed = f"{path}." if path else ""
            break
    if not blocks:
        seen = sorted({type(m).__name__ for m in model.modules()})
        raise UnsupportedModelError(
            f"No FFN block of a supported family found in {type(model).__name__} (module types: "
            f"{', '.join(seen[:30])}{', ...' if len(seen) > 30 else ''}). Supported families: {_supported_text()}. "
            "For another architecture, describe its FFN once with lightning_hetero.matformer.adapters."
            "register_adapter(FFNAdapter(family='my-model', module_types=('MyMLP',), inputs=('up_proj',), "
            "output='down_proj', model_types=('my_model',), size_field='intermediate_size'))."
        )
    return blocks


def ffn_parameters(model: nn.Module) -> list[FFNParameter]:
    """Every parameter of ``model`` with an axis along an FFN hidden dimension (see ``find_ffns``)."""
    return [param for block in find_ffns(model) for param in block.parameters]


def _adapters_for_model_type(model_type: str | None) -> list[FFNAdapter]:
    return [a for a in _ADAPTERS.values() if model_type in a.model_types]


def intermediate_size_field(config: Any) -> str:
    """Name of the config field that holds the FFN size for ``config.model_type``.

    Raises:
        UnsupportedModelError: no registered adapter lists this ``model_type``.
    """
    model_type = _config_get(config, "model_type")
    adapters = _adapters_for_model_type(model_type)
    if not adapters:
        known = sorted({t for a in _ADAPTERS.values() for t in a.model_types})
        raise UnsupportedModelError(
            f"Unknown FFN size field for model_type {model_type!r}; known model types: {', '.join(known)}. "
            "Register an adapter with model_types=(...,) and size_field=... (see register_adapter)."
        )
    return adapters[0].size_field


def config_intermediate_size(config: Any) -> int:
    """The FFN size ``h`` a config describes (GPT-2: ``n_inner``, or ``4 * n_embd`` when it is ``None``)."""
    field = intermediate_size_field(config)
    value = _config_get(config, field)
    if value is None:
        adapter = _adapters_for_model_type(_config_get(config, "model_type"))[0]
        if adapter.default_size is None:
            raise ValueError(f"config.{field} is None and family {adapter.family!r} defines no default FFN size.")
        return int(adapter.default_size(_AttrView(config)))
    if not isinstance(value, int):
        raise ValueError(f"config.{field} must be one int for all layers, got {value!r}.")
    return value


def default_intermediate_size(config: Any) -> int | None:
    """The FFN size a config implies when its size field is ``None`` (GPT-2: ``4 * n_embd``), else ``None``."""
    for adapter in _adapters_for_model_type(_config_get(config, "model_type")):
        if adapter.default_size is not None:
            return int(adapter.default_size(_AttrView(config)))
    return None


def _config_get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


class _AttrView:
    """Attribute access over a config dict, so ``default_size`` callables work on configs and dicts alike."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, key: str) -> Any:
        return _config_get(self._config, key)
