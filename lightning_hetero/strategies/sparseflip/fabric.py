"""``SparseFlipStrategy`` for Fabric: low-bit flip training with the sparse exchange in your own loop. Usage::

    from lightning_hetero.sparseflip import SparseFlipSettings

    fabric = Fabric(accelerator="cpu", devices=4, strategy=SparseFlipStrategy(SparseFlipSettings(kind="ternary")))
    fabric.launch()
    model = fabric.setup_module(model)  # Linear/Conv layers -> flip-mode codes, rank 0's state everywhere
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))  # the remaining fp parameters
    for batch in loader:
        fabric.backward(loss_fn(model, batch))  # fp gradients averaged, code gradients exchanged
        optimizer.step()                        # fp step, then the common flips
        optimizer.zero_grad()

``fabric.no_backward_sync(model)`` accumulates micro-batches without exchanging; :attr:`last_metrics` holds the
step's ``lowbit/*`` and ``comm/*`` figures.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from typing_extensions import override

from lightning_hetero.sparseflip.runtime import SparseFlipRuntime
from lightning_hetero.sparseflip.settings import DEFAULT_SETTINGS, SparseFlipSettings
from lightning_hetero.strategies.lifecycle import ReplacingFabricStrategyBase

__all__ = ["SparseFlipStrategy"]


class SparseFlipStrategy(ReplacingFabricStrategyBase[SparseFlipSettings]):
    """Fabric strategy: ternary/binary weights trained by flips, sparse code-gradient exchange between ranks."""

    settings_class = SparseFlipSettings
    runtime_class = SparseFlipRuntime
    setup_replaces = "replaces the Linear/Conv weights by flip codes"

    def __init__(self, settings: SparseFlipSettings = DEFAULT_SETTINGS, **kwargs: Any) -> None:
        """Takes a :class:`SparseFlipSettings`; ``**kwargs`` are Lightning's arguments (see the base class)."""
        super().__init__(settings, **kwargs)
        self.last_metrics: dict[str, float] = {}
        """The ``lowbit/*`` and ``comm/*`` metrics of the last optimizer step."""

    def set_total_steps(self, steps: int) -> None:
        """Tell the strategy how many optimizer steps the run has, so Bop's ``gamma`` decays over them."""
        self.runtime.total_steps = int(steps)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._claim_module(module)
        return self.runtime.setup(module, self.root_device)

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        if not self._sync_blocked:
            self.runtime.sync_gradients()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self.last_metrics = self.runtime.after_optimizer_step()
        return output
