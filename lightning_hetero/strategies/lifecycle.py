"""The lifecycle every lightning-hetero strategy shares, for the Trainer and for Fabric.

A strategy is a framework-free runtime (:class:`~lightning_hetero.core.StrategyRuntime`) plus two thin adapters:
one subclass of :class:`TrainerStrategyBase` and one of :class:`FabricStrategyBase`. The bases do what every
strategy needs, once:

- the launch check (``_configure_launcher`` -> ``runtime.resolve_launch``) before any process starts;
- process-group teardown at interpreter exit, whatever the backend (:func:`destroy_process_group_at_exit`);
- the no-sync scope of gradient accumulation (``block_backward_sync`` / ``fabric.no_backward_sync``);
- gradient clipping with the runtime's definition of the norm (``gradient_clip_val`` / ``fabric.clip_gradients``);
- checkpoints: the runtime's extra state under ``runtime.checkpoint_key``, and directory checkpoints (one part per
  writing rank plus metadata) for strategies whose ranks hold different tensors; every load is ``weights_only``
  whatever the caller or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says, and a checkpoint with a manifest is verified
  against it before a byte of it is unpickled (one without gets an ``UnverifiedCheckpointWarning``);
- ``runtime.teardown()`` at the end of a fit;
- the settings: an adapter declares ``settings_class`` and ``runtime_class`` and passes its ``settings`` on; the base
  refuses keywords renamed in 0.2 (``settings_class.RENAMED``) and unknown ones, naming the fix, and builds
  ``runtime_class(settings, owner=<the adapter's class name>)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeVar

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.strategies import DDPStrategy as TrainerDDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hetero.core import StrategyRuntime, WorldLayout, remove_checkpoint, write_part
from lightning_hetero.core.checkpoint_dir import require_safe_loading
from lightning_hetero.core.settings import reject_renamed
from lightning_hetero.reliability.checkpoints import verify_resume_checkpoint
from lightning_hetero.reliability.shutdown import destroy_process_group_at_exit
from lightning_hetero.reliability.timeouts import inherit_group_timeout

__all__ = ["FabricStrategyBase", "ReplacingFabricStrategyBase", "TrainerStrategyBase"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

SettingsT = TypeVar("SettingsT")
"""The strategy's settings class (``TrainerStrategyBase[MatFormerSettings]`` types ``strategy.settings``)."""


class _RuntimeLifecycle(Generic[SettingsT]):
    """What the Trainer and Fabric bases share (a mixin in front of Lightning's ``DDPStrategy`` of either)."""

    runtime: StrategyRuntime
    settings_class: ClassVar[type | None] = None
    """The strategy's settings dataclass; its ``RENAMED`` table (old keyword -> new key) is checked here and by
    ``HeteroCLI``."""
    runtime_class: ClassVar[Callable[..., StrategyRuntime] | None] = None
    """Builds the runtime from the settings: ``runtime_class(settings, owner=<the adapter's class name>)``."""
    _sync_blocked: bool = False
    verifies_checkpoints: bool = True
    """Loads check a checkpoint against its manifest themselves (``VerifiedCheckpoint`` need not do it again)."""

    @property
    def settings(self) -> SettingsT:
        """The strategy's settings (read-only)."""
        return self.runtime.settings  # type: ignore[attr-defined]

    def _attach_runtime(self, settings: SettingsT | StrategyRuntime, unknown: Mapping[str, Any]) -> None:
        """Set ``self.runtime``: ``settings`` as is if it is already a runtime, else ``runtime_class(settings)``.

        Raises:
            RenamedSettingError: ``unknown`` holds a keyword renamed in 0.2; the message names its new key.
            TypeError: ``unknown`` holds any other keyword, or the class declares no ``runtime_class``.
        """
        owner = type(self).__name__
        renamed = getattr(self.settings_class, "RENAMED", {})
        reject_renamed(owner, unknown, renamed)
        if unknown:
            where = self.settings_class.__name__ if self.settings_class is not None else "<the strategy's Settings>"
            raise TypeError(
                f"{owner}: unexpected keyword argument {', '.join(repr(k) for k in unknown)}. Strategy settings go "
                f"in one object, settings={where}(...); the other keywords are Lightning's (accelerator, "
                "process_group_backend, timeout, start_method, ...)."
            )
        if isinstance(settings, StrategyRuntime):
            self.runtime = settings  # an adapter that builds its own runtime
            return
        if self.runtime_class is None:
            raise TypeError(f"{owner} declares no runtime_class: set it, or pass a ready StrategyRuntime.")
        self.runtime = self.runtime_class(settings, owner=owner)

    @override
    def _configure_launcher(self) -> None:
        self.runtime.resolve_launch(WorldLayout(self.num_nodes, self.num_processes))  # type: ignore[attr-defined]
        super()._configure_launcher()  # type: ignore[misc]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        # Groups the runtime creates later (device mesh, pipeline, regions) get the strategy's timeout, not torch's
        # 30 minutes: a hung peer must fail every collective within `timeout`.
        inherit_group_timeout(getattr(self, "_timeout", None))
        destroy_process_group_at_exit()

    @contextmanager
    def _no_sync_scope(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate gradients without synchronizing them (nested scopes allowed)."""
        previous, self._sync_blocked = self._sync_blocked, True
        self.runtime.set_sync_blocked(True)
        try:
            yield
        finally:
            self._sync_blocked = previous
            self.runtime.set_sync_blocked(previous)

    def _save_directory_checkpoint(self, state: Mapping[str, Any], path: str | Path) -> None:
        """Every rank: the rank's part (if it writes one), rank 0 the metadata; a file of the same name goes first."""
        directory = Path(self.broadcast(str(path)))  # type: ignore[attr-defined]
        if directory.is_file() and self.is_global_zero:  # type: ignore[attr-defined]
            directory.unlink()  # a single-file checkpoint of another strategy under the same name
        self.barrier("lightning_hetero_checkpoint_prepare")  # type: ignore[attr-defined]
        part = self.runtime.checkpoint_part(self.global_rank)  # type: ignore[attr-defined]
        if part is not None:
            write_part(directory, part, state)
        if self.is_global_zero:  # type: ignore[attr-defined]
            self.runtime.write_checkpoint_meta(directory)
        self.barrier("lightning_hetero_checkpoint_saved")  # type: ignore[attr-defined]

    def _prepare_load(self, path: Any, weights_only: bool | None) -> None:
        """Before anything of ``path`` is unpickled: verify it against its manifest (warn when it has none) and make
        sure ``torch.load(weights_only=True)`` is what runs, whatever the caller or the environment asks for.

        Raises:
            CorruptCheckpointError, IncompleteCheckpointError: the checkpoint does not match its manifest.
            UnsafeLoadError: this torch would unpickle arbitrary objects despite ``weights_only=True``.
        """
        if weights_only is False:
            warnings.warn(
                f"{self.runtime.owner}: weights_only=False is ignored; checkpoints are always loaded with "
                "weights_only=True (tensors and plain containers), so a crafted file cannot run code. To load other "
                "types you trust, register them with torch.serialization.add_safe_globals([...]).",
                UserWarning,
                stacklevel=3,
            )
        verify_resume_checkpoint(path)
        require_safe_loading()

    def _load_directory_checkpoint(self, path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
        rank = self.global_rank  # type: ignore[attr-defined]
        return self.runtime.load_checkpoint_part(Path(path), rank, map_location=map_location)

    def _with_extra_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` plus the runtime's extra state (collective: every rank calls it)."""
        extra = self.runtime.extra_checkpoint_state(self.root_device)  # type: ignore[attr-defined]
        return dict(state) if extra is None else {**state, self.runtime.checkpoint_key: extra}

    def _restore_extra_state(self, checkpoint: dict[str, Any]) -> None:
        self.runtime.load_extra_checkpoint_state(checkpoint.pop(self.runtime.checkpoint_key, None))


class TrainerStrategyBase(_RuntimeLifecycle[SettingsT], TrainerDDPStrategy):
    """Base of our Trainer strategies: a Lightning ``DDPStrategy`` that drives ``self.runtime`` (no DDP wrapper).

    Args:
        settings: The strategy's settings (an instance of ``settings_class``), from which the base builds
            ``runtime_class(settings, owner=...)``; or a ready :class:`~lightning_hetero.core.StrategyRuntime`.
        accelerator: Set by the Trainer.
        parallel_devices: Set by the Trainer.
        cluster_environment: Set by the Trainer.
        checkpoint_io: Set by the Trainer.
        precision_plugin: Set by the Trainer.
        process_group_backend: ``torch.distributed`` backend (default: gloo on CPU, nccl on CUDA).
        timeout: Process group timeout.
        start_method: ``"popen"`` (scripts, the CLI) or ``"spawn"`` (notebooks, tests).
        **renamed: Nothing is accepted here: a keyword of 0.1 raises ``RenamedSettingError`` naming its new key, any
            other a ``TypeError``.
    """

    def __init__(
        self,
        settings: SettingsT | StrategyRuntime,
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Any | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "popen",
        **renamed: Any,
    ) -> None:
        self._attach_runtime(settings, renamed)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._sync_blocked = False
        self._clipping_patched = False

    def _only_optimizer(self, why: str) -> Optimizer:
        """The one optimizer ``configure_optimizers`` returned.

        Raises:
            ValueError: It returned none or several, saying ``why`` one is needed.
        """
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{self.runtime.owner} needs exactly one optimizer from configure_optimizers, got "
                f"{len(self.optimizers)}: {why}."
            )
        return self.optimizers[0]

    def _use_runtime_clipping(self) -> None:
        """Make ``gradient_clip_val`` clip with ``runtime.clip_grad_norm_`` (undone in ``teardown``)."""
        if not self._clipping_patched:
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
            self._clipping_patched = True

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float | int) -> None:
        self.runtime.clip_grad_norm_(self.precision_plugin.main_params(optimizer), clip_val)

    def _global_step(self) -> int:
        module = self.lightning_module
        return module.trainer.global_step if module is not None and module._trainer is not None else 0

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self._no_sync_scope():
            yield None

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._interrupted = True  # teardown must not wait for peers that may be gone
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if not getattr(self, "_interrupted", False):
            # After a normal end, no rank destroys its process group while a peer may still be inside a collective
            # (asynchronous works finishing after their owner tore down can abort gloo at exit).
            self.barrier("lightning_hetero_teardown")
        self._interrupted = False
        self.runtime.teardown()
        if self._clipping_patched:
            del self.precision_plugin.clip_grad_by_norm  # the instance attribute; the class method is back
            self._clipping_patched = False
        super().teardown()

    # ------------------------------------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self.runtime.restore_after_setup or super().restore_checkpoint_after_setup

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        checkpoint = self._with_extra_state(checkpoint)
        if not self.runtime.directory_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{self.runtime.owner}.save_checkpoint does not take storage_options.")
        self._save_directory_checkpoint(checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self._prepare_load(checkpoint_path, weights_only)
        if self.runtime.directory_checkpoint:
            checkpoint = self._load_directory_checkpoint(checkpoint_path)
        else:  # never what the caller passed: None lets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD unpickle anything
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=True)
        self._restore_extra_state(checkpoint)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.runtime.directory_checkpoint:
            super().remove_checkpoint(filepath)
        elif self.is_global_zero:
            remove_checkpoint(filepath)


class _NoSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the backward passes inside do not synchronize gradients."""

    def __init__(self, strategy: FabricStrategyBase) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._strategy._no_sync_scope() if enabled else nullcontext()


class FabricStrategyBase(_RuntimeLifecycle[SettingsT], FabricDDPStrategy):
    """Base of our Fabric strategies: a Fabric ``DDPStrategy`` that drives ``self.runtime`` for one model.

    Args:
        settings: The strategy's settings (an instance of ``settings_class``), from which the base builds
            ``runtime_class(settings, owner=...)``; or a ready :class:`~lightning_hetero.core.StrategyRuntime`.
        accelerator: Set by Fabric.
        parallel_devices: Set by Fabric.
        cluster_environment: Set by Fabric.
        checkpoint_io: Set by Fabric.
        precision: Set by Fabric.
        process_group_backend: ``torch.distributed`` backend (default: gloo on CPU, nccl on CUDA).
        timeout: Process group timeout.
        start_method: ``"popen"`` (scripts) or ``"spawn"`` (``fabric.launch(fn)`` in notebooks and tests).
        **renamed: As for :class:`TrainerStrategyBase`.
    """

    def __init__(
        self,
        settings: SettingsT | StrategyRuntime,
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Any | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "popen",
        **renamed: Any,
    ) -> None:
        self._attach_runtime(settings, renamed)
        share = getattr(self.runtime.settings, "batch_share", None)  # type: ignore[attr-defined]
        if share is not None:
            raise ValueError(
                f"{self.runtime.owner}(settings.batch_share={share!r}): batch shares are Trainer-only for now (the "
                "strategy rebuilds the Trainer's train loader). With Fabric, set batch_share=None and build each "
                "rank's loader with lightning_hetero.hetero.batch_share.ShareBatchSampler (docs/batch_share.md)."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _NoSyncControl(self)
        self._sync_blocked = False
        self._module: nn.Module | None = None

    def _claim_module(self, module: nn.Module) -> None:
        if self._module is not None:
            raise RuntimeError(f"{self.runtime.owner} trains one model per Fabric; setup_module was already called.")
        self._module = module

    def _require_module(self) -> nn.Module:
        if self._module is None:
            raise RuntimeError(f"{self.runtime.owner} needs fabric.setup_module(model) first.")
        return self._module

    def _setup_and_repoint(self, module: nn.Module, optimizers: list[Optimizer]) -> nn.Module:
        """``setup_module``, then point the optimizers at the parameters it replaced (same names)."""
        before = dict(module.named_parameters())
        module = self.setup_module(module)
        replaced = {id(before[n]): p for n, p in module.named_parameters() if n in before and before[n] is not p}
        for optimizer in optimizers:
            if replaced and any(optimizer.state.values()):
                raise RuntimeError(
                    f"{self.runtime.owner} replaced the model's parameters, but the optimizer already holds state for "
                    "the old ones. Call fabric.setup_module(model) first, then build the optimizer."
                )
            for group in optimizer.param_groups:
                group["params"] = [replaced.get(id(p), p) for p in group["params"]]
        return module

    def _require_optimizers_follow(self, module: nn.Module, optimizers: list[Optimizer], why: str) -> None:
        """Raise if an optimizer holds parameters ``module`` no longer has (it was built before ``setup_module``)."""
        kept = {id(p) for p in module.parameters()}
        for optimizer in optimizers:
            if any(id(p) not in kept for group in optimizer.param_groups for p in group["params"]):
                raise RuntimeError(
                    f"{self.runtime.owner} {why}, so an optimizer built before setup holds parameters the model no "
                    "longer has. Call model = fabric.setup_module(model) first, then build the optimizer from "
                    "model.parameters() and pass it to fabric.setup_optimizers."
                )

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self.precision.unscale_gradients(optimizer)
        parameters = self.precision.main_params(optimizer)
        return self.runtime.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)

    @override
    def teardown(self) -> None:
        self.runtime.teardown()
        super().teardown()

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if not self.runtime.directory_checkpoint:
            state = self._with_extra_state(state)
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        if storage_options is not None:
            raise TypeError(f"{self.runtime.owner}.save_checkpoint does not take storage_options.")
        converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
        self._save_directory_checkpoint(self._with_extra_state(converted), path)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        self._prepare_load(path, weights_only)
        if not self.runtime.directory_checkpoint:  # weights_only forced: see TrainerStrategyBase.load_checkpoint
            remainder = super().load_checkpoint(path, state, strict, weights_only=True)
            self._restore_extra_state(remainder)
            return remainder
        checkpoint = self._load_directory_checkpoint(path, map_location=self.root_device)
        self._restore_extra_state(checkpoint)
        return self._apply_checkpoint(checkpoint, state, strict, path)

    def _apply_checkpoint(self, checkpoint: dict[str, Any], state: Any, strict: bool, path: Any) -> dict[str, Any]:
        """Load ``checkpoint`` into ``state`` as ``fabric.load`` does; returns what ``state`` did not ask for."""
        if not state:
            return checkpoint
        if isinstance(state, nn.Module):
            self.load_module_state_dict(state, checkpoint, strict=strict)
            return {}
        if isinstance(state, Optimizer):
            state.load_state_dict(checkpoint)
            return {}
        missing = [key for key in state if key not in checkpoint]
        if strict and missing:
            raise KeyError(f"The checkpoint at {path} has no entries {missing} (requested in `state`).")
        for name, obj in list(state.items()):
            if name not in checkpoint:
                continue
            if isinstance(obj, nn.Module):
                self.load_module_state_dict(obj, checkpoint.pop(name), strict=strict)
            elif isinstance(obj, Optimizer) or hasattr(obj, "load_state_dict"):
                obj.load_state_dict(checkpoint.pop(name))
            else:
                state[name] = checkpoint.pop(name)
        return checkpoint


class ReplacingFabricStrategyBase(FabricStrategyBase[SettingsT]):
    """A Fabric strategy whose ``setup_module`` replaces the model's parameters (by a stage, by flip codes).

    The optimizers are built after it: ``fabric.setup(model, optimizer)`` with an optimizer built before raises.
    """

    setup_replaces: ClassVar[str] = "replaces the model's parameters"
    """What ``setup_module`` does to the model, in the error of an optimizer built before it."""

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        module = self.setup_module(module)
        self._require_optimizers_follow(module, optimizers, self.setup_replaces)
        return module, optimizers, scheduler

    @override
    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)
