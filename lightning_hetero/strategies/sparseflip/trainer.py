"""``SparseFlipStrategy`` for the Lightning Trainer: low-bit weights trained by flips, exchanged as sparse lists.

The work is done by :class:`~lightning_hetero.sparseflip.runtime.SparseFlipRuntime`; this adapter decides when:

- ``setup`` (before precision, optimizers and checkpoint restore): the model's Linear / Conv2d / HF Conv1D layers
  become flip-mode ternary (or binary) layers, rank 0's state is copied everywhere, ``configure_optimizers`` then
  sees only the remaining fp parameters (biases, norms, embeddings, heads, scales). No DDP wrapper.
- ``post_backward`` (final micro-batch only): fp gradients averaged, code gradients thresholded and exchanged.
- ``optimizer_step``: the user's optimizer steps the fp parameters, then every rank applies the same flips.
  ``lowbit/flips``, ``lowbit/selected`` and ``comm/*`` bytes are logged per step.

Checkpoints are Lightning's single file from rank 0: the codes and scales are buffers of the module's state dict.

Lightning's model summary counts parameters only, so its "Total params" leaves the low-bit weights out (their codes
are int8 buffers): right after the conversion the strategy prints ``SparseFlipStrategy: low-bit weights: N (ternary
codes) in L layers, ...`` on rank 0, just before the summary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_hetero.sparseflip.layers import lowbit_layers
from lightning_hetero.sparseflip.runtime import SparseFlipRuntime
from lightning_hetero.sparseflip.settings import DEFAULT_SETTINGS, SparseFlipSettings
from lightning_hetero.strategies.lifecycle import TrainerStrategyBase
from lightning_hetero.strategies.metric_names import log_step_metrics

__all__ = ["SparseFlipStrategy", "lowbit_summary"]


def lowbit_summary(module: nn.Module, kind: str) -> str:
    """One line on what Lightning's model summary does not count: the low-bit weights (int8 code buffers)."""
    layers = lowbit_layers(module, mode="flip")
    codes = sum(layer.codes.numel() for _, layer in layers)
    fp = sum(p.numel() for p in module.parameters())
    return (
        f"SparseFlipStrategy: low-bit weights: {codes:,} ({kind} codes, int8 buffers) in {len(layers)} layers; they "
        f"are not in the model summary's 'Total params', which counts the {fp:,} fp parameters (biases, norms, "
        f"scales, skipped layers)."
    )


class SparseFlipStrategy(TrainerStrategyBase[SparseFlipSettings]):
    """Ternary/binary weights trained by flips; ranks exchange thresholded sparse code gradients (seed 003).

    A keyword of 0.1 (``kind``, ``density``, ...) raises ``RenamedSettingError`` naming its new key.
    """

    settings_class = SparseFlipSettings
    runtime_class = SparseFlipRuntime

    def __init__(self, settings: SparseFlipSettings = DEFAULT_SETTINGS, **kwargs: Any) -> None:
        """Takes a :class:`SparseFlipSettings`; ``**kwargs`` are Lightning's arguments (see the base class)."""
        super().__init__(settings, **kwargs)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.lightning_module is not None
        self.runtime.setup(self.lightning_module, self.root_device)  # before optimizers, precision and restore
        rank_zero_info(lowbit_summary(self.lightning_module, self.settings.kind))
        super().setup(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        total = getattr(trainer, "estimated_stepping_batches", None)
        if isinstance(total, (int, float)) and total > 0 and total != float("inf"):
            self.runtime.total_steps = int(total)  # Bop's gamma decays over the run

    @override
    def configure_ddp(self) -> None:
        pass  # no DDP wrapper: fp gradients are averaged and codes exchanged in post_backward

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        pass

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if not self._sync_blocked:
            self.runtime.sync_gradients()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        metrics = self.runtime.after_optimizer_step()
        if self.settings.log_comm_stats:
            log_step_metrics(self.lightning_module, metrics)
        return output
