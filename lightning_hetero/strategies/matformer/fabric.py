"""``MatFormerStrategy`` for Fabric: tiered MatFormer data parallelism in your own training loop.

The work is done by :class:`~lightning_hetero.matformer.runtime.MatFormerRuntime`, shared with the Trainer strategy;
this module decides when it runs. Usage::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1])))
    fabric.launch()
    model = fabric.setup_module(model)  # rank 0's weights everywhere, then this rank's FFNs cut to its tier
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    for batch in loader:
        fabric.backward(model(**batch).loss)  # backward, then the per-region gradient sync
        optimizer.step()
        optimizer.zero_grad()

With ``settings.tiers="auto"``, give the probe its loss before ``setup_module`` (each rank times it on a sliced copy
per candidate tier)::

    fabric.strategy.set_probe_step(lambda model: model(**probe_batch).loss)

``fabric.no_backward_sync(model)`` skips the sync for accumulation micro-batches. ``fabric.setup(model, optimizer)``
works too: the optimizer, which must not hold state yet, is re-pointed at the sliced parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hetero.matformer.auto_tiers import ProbeStep
from lightning_hetero.matformer.layout import TierLayout
from lightning_hetero.matformer.runtime import MatFormerRuntime
from lightning_hetero.matformer.settings import DEFAULT_SETTINGS, MatFormerSettings
from lightning_hetero.strategies.lifecycle import FabricStrategyBase

__all__ = ["MatFormerStrategy"]


class _SlicingOptimizerLoader:
    """Stands in for an optimizer in ``Strategy.load_checkpoint``: slices rank 0's state before loading it."""

    def __init__(self, strategy: MatFormerStrategy, optimizer: Optimizer) -> None:
        self._strategy, self._optimizer = strategy, optimizer

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(self._strategy._slice_optimizer_state(state, self._optimizer))


class MatFormerStrategy(FabricStrategyBase[MatFormerSettings]):
    """Fabric strategy for tiered MatFormer data parallelism: each rank trains its own FFN prefix of one model.

    No DDP wrapper: ranks hold different shapes. ``fabric.backward(loss)`` runs the per-region gradient sync right
    after backward (skipped inside ``fabric.no_backward_sync``); :meth:`sync_gradients` does it by hand.
    ``fabric.clip_gradients(model, optimizer, max_norm=...)`` clips every rank with the full model's norm.
    Checkpoints (``fabric.save``) hold rank 0's full model and optimizer; ``fabric.load`` slices them for each rank.
    """

    settings_class = MatFormerSettings
    runtime_class = MatFormerRuntime

    def __init__(self, settings: MatFormerSettings = DEFAULT_SETTINGS, **kwargs: Any) -> None:
        """Takes a :class:`MatFormerSettings`; ``**kwargs`` are Lightning's arguments (see the base class)."""
        super().__init__(settings, **kwargs)
        if self.settings.fault_tolerance is not None:
            raise ValueError(
                "lightning_hetero.fabric.MatFormerStrategy(settings.fault_tolerance=...): the fault-tolerant (spot "
                "worker) mode of MatFormer runs in the Trainer only (its steps are gated on the quorum's commit). Use "
                "lightning_hetero.MatFormerStrategy with a Trainer, or drop fault_tolerance; see docs/spot.md."
            )
        self.step = 0
        """Optimizer steps so far (one per gradient sync); selects the helper draw."""
        self._probe: ProbeStep | None = None

    def set_probe_step(self, loss: Callable[[nn.Module], Tensor]) -> None:
        """``tiers="auto"``: how to compute a training loss on a copy of the model (call before ``setup_module``, in
        the launched function: the callable need not pickle).

        Args:
            loss: ``loss(model)`` runs the forward on a probe batch already on this rank's device and returns the
                scalar loss; the probe adds the backward and an AdamW step.
        """
        self._probe = ProbeStep(loss=loss, context=self.precision.forward_context)

    @property
    def tier(self) -> int | None:
        """This rank's tier (None for per-layer or non power-of-two widths)."""
        return self.runtime.tier_of(self.global_rank)

    @property
    def layout(self) -> TierLayout | None:
        """Every rank's width in every FFN (after ``setup_module``)."""
        return self.runtime.layout

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._claim_module(module)
        self.runtime.auto_probe = self._probe
        self.runtime.setup(module, self.root_device, self._current_step)
        report = self.runtime.auto_choice_report()
        if report is not None:
            rank_zero_info(report)
        scaler = getattr(self.precision, "scaler", None)
        if self.runtime.heterogeneous and isinstance(self.precision, MixedPrecision) and scaler is not None:
            raise ValueError(
                "MatFormerStrategy with mixed tiers cannot use precision='16-mixed': each rank's GradScaler would skip "
                "steps on its own gradients and the shared weights would drift apart. Use 'bf16-mixed' or '32-true'."
            )
        return module

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        module = self._setup_and_repoint(module, optimizers)  # slicing replaces the FFN parameters
        return module, optimizers, scheduler

    def _current_step(self) -> int:
        return self.step

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        if not self._sync_blocked:
            self.sync_gradients()

    def sync_gradients(self, step: int | None = None) -> None:
        """Aggregate the gradients per region now (collective); ``step`` overrides the helper-draw step."""
        module = self._require_module()
        if step is not None:
            self.step = step
        self.runtime.sync_gradients(module, self.step)
        self.step += 1

    def gather_full_model(self) -> None:
        """Give every rank rank 0's full model (collective), e.g. before evaluating the full model everywhere."""
        if self._module is not None:
            self.runtime.restore_full(self._module)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if module is self._module:
            state_dict = dict(self.runtime.slice_model_state(state_dict))
        super().load_module_state_dict(module, state_dict, strict)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if isinstance(state, Optimizer):
            self._prepare_load(path, weights_only)  # verified, and never unpickled whatever weights_only says
            checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=True)
            state.load_state_dict(self._slice_optimizer_state(checkpoint, state))
            return {}
        if not isinstance(state, dict):
            return super().load_checkpoint(path, state, strict, weights_only)
        proxied = {k: _SlicingOptimizerLoader(self, v) if isinstance(v, Optimizer) else v for k, v in state.items()}
        remainder = super().load_checkpoint(path, proxied, strict, weights_only)
        for key, value in proxied.items():  # the base class replaces plain values in the dict it was given
            if not isinstance(value, _SlicingOptimizerLoader):
                state[key] = value
        return remainder

    def _slice_optimizer_state(self, state: dict[str, Any], optimizer: Optimizer) -> Any:
        return self.runtime.slice_optimizer_state(state, optimizer, self._require_module())
