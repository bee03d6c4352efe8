"""``SparseFlipStrategy`` for the Lightning Trainer: low-bit weights trained by flips, exchanged as sparse lists.

The work is done by :class:`~lightning_hetero.lowbit.runtime.SparseFlipRuntime`; this adapter decides when:

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

from lightning_hetero.core import runtime_arguments
from lightning_hetero.lowbit.layers import lowbit_layers
from lightning_hetero.lowbit.runtime import SparseFlipRuntime
from lightning_hetero.strategies.lifecycle import TrainerStrategyBase

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


class SparseFlipStrategy(TrainerStrategyBase):
    """Ternary/binary weights trained by flips; ranks exchange thresholded sparse code gradients (seed 003).

    Args:
        kind: ``"ternary"`` or ``"binary"``.
        granularity: ``"row"`` (a scale per output channel) or ``"layer"``.
        flip_rule: ``"local_bop"`` (each rank keeps Bop's momentum of its own gradient and sends the momenta past
            ``send_fraction * bop_threshold``; codes whose mean momentum passes ``bop_threshold`` move; the measured
            best), ``"bop"`` (Bop on the server over the aggregated sparse gradients) or ``"topk"`` (the seed's
            top-``k`` of the summed lists).
        send_fraction: ``"local_bop"``: a rank sends momenta above this fraction of ``bop_threshold``.
        flips_per_step: At most this many flips per step (``k``); None: ``ceil(flip_fraction * codes)``.
        flip_fraction: ``k`` as a fraction of the codes. None: 0.001 for ``"topk"``, no cap for ``"bop"``.
        bop_gamma: Bop's momentum rate, cosine-decayed to ``bop_decay_to`` x over the run (Trainer: from
            ``estimated_stepping_batches``).
        bop_threshold: Bop's threshold, a fraction of each layer's rms gradient.
        bop_decay_to: Final fraction of ``bop_gamma``.
        trainable_scale: The fp scales are parameters trained by your optimizer (with biases, norms, ...).
        zero_fraction: Ternary start: this fraction of each row's smallest weights begins at 0 (None: rounding).
        tau: Fixed send threshold on ``|g|``; exclusive with ``density``.
        density: Fraction of the codes each rank sends (default: ``tau = send_fraction * bop_threshold`` on the
            momenta for ``"local_bop"``, else 0.01).
        encoding: Sent values: ``"sign"`` (1 bit + one scale per message: a vote), ``"ternary"``, ``"bf16"``,
            ``"fp32"``.
        aggregation: ``"server"`` (parameter server ``server``) or ``"allgather"`` (decentralized, same flips).
        server: Global rank of the parameter server.
        skip: Module-name patterns kept in fp (default: heads, classifiers, embeddings).
        include: Layer types to convert (default ``["Linear", "Conv2d", "Conv1D"]``).
        drift_check_every: Check every N steps that all ranks hold bit-identical state (0: off).
        on_nonfinite: ``"raise"`` or ``"skip"`` (warn and apply no flips) on a NaN/Inf code gradient.
        fp_density: None: fp gradients (biases, norms, embeddings, heads) are averaged densely. A fraction: each
            rank sends only that share of them, sparse, with error feedback (residuals saved in checkpoints).
        log_comm_stats: Log ``lowbit/*`` and ``comm/*`` per step.
        on_bad_payload: What a corrupt peer payload does (see ``docs/reliability.md``): ``"raise"`` a
            :class:`~lightning_hetero.comm.validation.PeerPayloadError` (default), or ``"drop"`` it and log.
        **kwargs: Lightning's arguments (``accelerator``, ``precision_plugin``, ``process_group_backend``,
            ``timeout``, ``start_method``, ...); see :class:`~lightning_hetero.strategies.TrainerStrategyBase`.
    """

    def __init__(
        self,
        kind: str = "ternary",
        granularity: str = "row",
        flip_rule: str = "local_bop",
        send_fraction: float = 1.0,
        flips_per_step: int | None = None,
        flip_fraction: float | None = None,
        bop_gamma: float = 0.03,
        bop_threshold: float = 0.2,
        bop_decay_to: float = 0.1,
        trainable_scale: bool = True,
        zero_fraction: float | None = 0.5,
        tau: float | None = None,
        density: float | None = None,
        encoding: str = "sign",
        aggregation: str = "server",
        server: int = 0,
        skip: list[str] | None = None,
        include: list[str] | None = None,
        drift_check_every: int = 0,
        on_nonfinite: str = "raise",
        fp_density: float | None = None,
        log_comm_stats: bool = True,
        on_bad_payload: str = "raise",
        **kwargs: Any,
    ) -> None:
        super().__init__(SparseFlipRuntime(**runtime_arguments(SparseFlipRuntime, locals())), **kwargs)
        self.log_comm_stats = bool(log_comm_stats)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.lightning_module is not None
        self.runtime.setup(self.lightning_module, self.root_device)  # before optimizers, precision and restore
        rank_zero_info(lowbit_summary(self.lightning_module, self.runtime.kind))
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
        module = self.lightning_module
        if self.log_comm_stats and module is not None and module._trainer is not None:
            for name, value in metrics.items():
                module.log(name, value, on_step=True, on_epoch=False, batch_size=1, rank_zero_only=True)
        return output
