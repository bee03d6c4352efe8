"""Elastic MatFormer training in one process: :class:`MatFormerSampler` trains every granularity of one model.

Each training micro-batch runs its forward, backward and optimizer step inside ``tier_view(pl_module, tier)``, with
the tier drawn per optimizer step (``rule="random"``) or cycled largest / smallest / random middle across the
micro-batches of one step (``rule="sandwich"``). Under a tiered strategy every rank already trains its own fixed
tier, so the sampler refuses to run there.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hetero.matformer.slicing import tier_view
from lightning_hetero.strategies.matformer.callbacks.tier_common import (
    check_tiers_fit,
    is_tiered,
    strategy_tier,
    validate_tiers,
)

__all__ = ["RULES", "MatFormerSampler"]

#: Sampling rules of :class:`MatFormerSampler`.
RULES: tuple[str, ...] = ("random", "sandwich")


class MatFormerSampler(Callback):
    """Elastic MatFormer training in one process: each training micro-batch runs at one sampled granularity.

    In ``on_train_batch_start`` the sampler enters ``tier_view(pl_module, tier)``; it leaves it in
    ``on_train_batch_end``. Lightning's automatic optimization runs the forward (``training_step``), the backward and,
    on the last micro-batch of an accumulation window, gradient clipping, the optimizer step and ``zero_grad``
    between these two hooks, so the whole step sees the tier: parameters stay full-size, the tier's prefix gets the
    gradient and the suffix of every FFN ``.grad`` is exactly zero. Validation, checkpointing and every other hook
    run at full width. The context is also closed on ``on_train_epoch_end``, ``on_train_end``, ``on_exception``
    and ``teardown``, so an error never leaves the model patched.

    Rules:

    * ``"random"``: one tier per **optimizer step**, uniform over ``tiers``; every micro-batch of a step (gradient
      accumulation) uses it, so each step's gradient is one submodel's full-batch gradient, at the cost of one
      forward/backward per micro-batch. With manual optimization, a step is one ``training_step`` call.
    * ``"sandwich"`` (the sandwich rule of Universally Slimmable Networks): each optimizer step trains
      ``len(tiers)`` granularities, one per micro-batch, in the order ``[largest (min(tiers)), smallest
      (max(tiers)), random middle tiers...]``. The ``len(tiers) - 2`` middle tiers are drawn uniformly, with
      replacement, from the tiers strictly between the two. Requires ``Trainer(accumulate_grad_batches=len(tiers))``
      (checked when fit starts), so each micro-batch is a different batch of data.

    The sequence is deterministic given ``seed`` (the sampler owns its ``torch.Generator``; ``seed_everything`` does
    not affect it) and the generator state, plus the tiers planned for the current step, are saved in checkpoints so
    a resumed run continues the same sequence. In multi-process data parallelism (DDP), every rank draws the same
    tier because every rank has the same seed, so the averaged gradient is one submodel's.

    Logs ``train/tier`` (the tier of the micro-batch; with the sandwich rule, the logger writes the last micro-batch
    of the step). ``history`` holds the tier of every training micro-batch of this process, ``counts`` (checkpointed)
    the number of micro-batches per tier.

    A tiered strategy (``trainer.strategy`` has a ``tier``, e.g. ``MatFormerStrategy``) already gives each rank a
    fixed tier; the sampler refuses to run there.

    Note: with AdamW, the suffix of a parameter still moves on steps at tier > 0 (momentum from earlier steps and
    decoupled weight decay); only its gradient is zero.

    Args:
        tiers: Granularities to train; tier ``t`` keeps ``h >> t`` FFN units. Distinct ints >= 0.
        rule: ``"random"`` or ``"sandwich"``.
        seed: Seed of the sampler's own random generator.

    Example (LightningCLI YAML)::

        trainer:
          accumulate_grad_batches: 4   # = len(tiers) for the sandwich rule
          callbacks:
            - class_path: lightning_hetero.strategies.matformer.callbacks.MatFormerSampler
              init_args: {tiers: [0, 1, 2, 3], rule: sandwich, seed: 0}
    """

    def __init__(self, tiers: list[int] = [0, 1, 2, 3], rule: str = "random", seed: int = 0) -> None:  # noqa: B006
        self.tiers = validate_tiers("MatFormerSampler", tiers)
        if rule not in RULES:
            raise ValueError(f"MatFormerSampler(rule={rule!r}): use one of {', '.join(repr(r) for r in RULES)}.")
        if rule == "sandwich" and len(self.tiers) < 2:
            raise ValueError(
                f"MatFormerSampler(rule='sandwich', tiers={self.tiers}): the sandwich rule trains the largest and the "
                "smallest tier every step, so it needs at least two tiers, e.g. tiers=[0, 3]."
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"MatFormerSampler(seed={seed!r}): seed must be an int.")
        self.rule = rule
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._plan: list[int] = []
        self._context: AbstractContextManager[Any] | None = None
        self.current_tier: int | None = None
        self.history: list[int] = []
        self.counts: dict[int, int] = {tier: 0 for tier in self.tiers}

    @property
    def sandwich_size(self) -> int:
        """Micro-batches (= granularities) per optimizer step under the sandwich rule: ``len(tiers)``."""
        return len(self.tiers)

    def _draw(self, n: int) -> int:
        return int(torch.randint(n, (1,), generator=self._generator).item())

    def next_plan(self) -> list[int]:
        """Draw the tiers of the next optimizer step (advances the generator).

        Returns:
            ``[tier]`` for the random rule (used by every micro-batch of the step), or the ``len(tiers)`` tiers of
            the step's micro-batches for the sandwich rule.
        """
        if self.rule == "random":
            return [self.tiers[self._draw(len(self.tiers))]]
        largest, smallest = min(self.tiers), max(self.tiers)
        middle = sorted(tier for tier in self.tiers if tier not in (largest, smallest))
        plan = [largest, smallest]
        for _ in range(len(self.tiers) - 2):
            plan.append(middle[self._draw(len(middle))])
        return plan

    def _enter(self, pl_module: LightningModule, tier: int) -> None:
        context = tier_view(pl_module, tier)
        context.__enter__()
        self._context = context
        self.current_tier = tier

    def _exit(self) -> None:
        context, self._context = self._context, None
        self.current_tier = None
        if context is not None:
            context.__exit__(None, None, None)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if is_tiered(trainer):
            raise RuntimeError(
                f"MatFormerSampler samples a granularity per step in one process, but the strategy "
                f"{type(trainer.strategy).__name__} is tiered (this rank trains tier {strategy_tier(trainer)}): each "
                "rank already trains its fixed tier. Remove MatFormerSampler from the callbacks, or use a non-tiered "
                "strategy."
            )
        check_tiers_fit("MatFormerSampler", pl_module, self.tiers)
        accumulate = trainer.accumulate_grad_batches
        if self.rule == "sandwich" and accumulate != self.sandwich_size:
            manual = "" if pl_module.automatic_optimization else " (manual optimization never accumulates)"
            raise ValueError(
                f"MatFormerSampler(rule='sandwich', tiers={self.tiers}) trains {self.sandwich_size} granularities per "
                f"optimizer step, one per micro-batch ([largest, smallest, {self.sandwich_size - 2} random middle]), "
                f"so it needs Trainer(accumulate_grad_batches={self.sandwich_size}); got {accumulate}{manual}."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        batches = trainer.num_training_batches
        size = self.sandwich_size
        reaches_epoch_end = trainer.max_steps < 0 or trainer.max_steps * size > batches
        if self.rule == "sandwich" and math.isfinite(batches) and int(batches) % size and reaches_epoch_end:
            rank_zero_warn(
                f"MatFormerSampler(rule='sandwich'): an epoch has {int(batches)} training batches, not a multiple of "
                f"accumulate_grad_batches={size}, so the last optimizer step of each epoch trains only part of the "
                "sandwich. Make limit_train_batches a multiple of it for full sandwiches."
            )

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._exit()  # a previous batch whose end hook never ran (a module returning -1 from on_train_batch_start)
        position = batch_idx % trainer.accumulate_grad_batches  # micro-batch within the optimizer step
        if position == 0 or not self._plan:
            self._plan = self.next_plan()
        tier = self._plan[position % len(self._plan)]
        self._enter(pl_module, tier)
        self.history.append(tier)
        self.counts[tier] = self.counts.get(tier, 0) + 1
        pl_module.log("train/tier", float(tier), on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._exit()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._exit()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._exit()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._exit()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._exit()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "tiers": list(self.tiers),
            "seed": self.seed,
            "rng_state": self._generator.get_state(),
            "plan": list(self._plan),
            "counts": dict(self.counts),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = (state_dict.get("rule"), list(state_dict.get("tiers", [])), state_dict.get("seed"))
        if saved != (self.rule, self.tiers, self.seed):
            rank_zero_warn(
                f"MatFormerSampler: the checkpoint was written with rule={saved[0]!r}, tiers={saved[1]}, "
                f"seed={saved[2]}, but this run uses rule={self.rule!r}, tiers={self.tiers}, seed={self.seed}; the "
                "tier sequence restarts from this run's seed instead of continuing."
            )
            return
        self._generator.set_state(state_dict["rng_state"].clone())
        self._plan = [int(tier) for tier in state_dict.get("plan", [])]
        self.counts = {int(tier): int(count) for tier, count in state_dict.get("counts", {}).items()}
