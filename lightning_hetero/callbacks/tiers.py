"""MatFormer callbacks: elastic granularity sampling, per-tier validation and per-tier export.

These callbacks put the framework-free building blocks of :mod:`lightning_hetero.matformer` (``tier_view``,
``export_tier``) into any Lightning ``Trainer``:

* :class:`MatFormerSampler` trains *every* granularity of one model in a single process (elastic MatFormer): each
  training micro-batch runs its forward, backward and optimizer step inside ``tier_view(pl_module, tier)``, with the
  tier drawn per optimizer step (``rule="random"``) or cycled largest / smallest / random middle across the
  micro-batches of one step (``rule="sandwich"``).
* :class:`TierEvaluation` logs ``val/loss_tier{t}`` and ``val/perplexity_tier{t}`` after every validation epoch.
* :class:`TierExport` writes one standard Hugging Face checkpoint per tier when ``fit`` ends.

A tier ``t`` keeps the first ``h >> t`` hidden units of every FFN (see ``docs/matformer.md``). Under a *tiered*
strategy (one whose ``trainer.strategy`` has a ``tier`` attribute, e.g. ``MatFormerStrategy``), every rank trains its
own fixed tier: the sampler refuses to run there, and evaluation and export happen on global rank 0, which holds the
full (tier-0) model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from transformers import PreTrainedModel
from typing_extensions import override

from lightning_hetero.callbacks.eval_report import mean_validation_loss
from lightning_hetero.matformer.adapters import FFNBlock, find_ffns
from lightning_hetero.matformer.export import export_tier
from lightning_hetero.matformer.slicing import tier_view

__all__ = [
    "DEFAULT_MAX_TIER",
    "RULES",
    "MatFormerSampler",
    "TierEvaluation",
    "TierExport",
    "default_tiers",
    "find_hf_model",
    "strategy_tier",
]

#: Sampling rules of :class:`MatFormerSampler`.
RULES: tuple[str, ...] = ("random", "sandwich")
#: The default tiers of :class:`TierEvaluation` / :class:`TierExport` stop here: {h, h/2, h/4, h/8}, the paper's four
#: granularities.
DEFAULT_MAX_TIER = 3


# ------------------------------------------------------------------------------------------------------- helpers
def strategy_tier(trainer: Trainer) -> int | None:
    """This rank's tier under a tiered strategy (``trainer.strategy.tier``), or None for any other strategy."""
    return getattr(trainer.strategy, "tier", None)


def _is_tiered(trainer: Trainer) -> bool:
    """Whether the strategy trains a fixed tier per rank (it has a ``tier`` attribute, even if not set yet)."""
    try:
        return hasattr(trainer.strategy, "tier")
    except Exception:  # a property that fails before setup still marks a tiered strategy
        return True


def _validate_tiers(owner: str, tiers: Any) -> list[int]:
    """A copy of ``tiers`` after checking it is a non-empty list of distinct ints >= 0."""
    if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Iterable):
        raise ValueError(f"{owner}(tiers={tiers!r}): pass a list of tiers, e.g. tiers=[0, 1, 2, 3].")
    tiers = list(tiers)
    if not tiers:
        raise ValueError(f"{owner}(tiers=[]): pass at least one tier, e.g. tiers=[0, 1, 2, 3].")
    for tier in tiers:
        if isinstance(tier, bool) or not isinstance(tier, int) or tier < 0:
            raise ValueError(
                f"{owner}(tiers={tiers!r}): every tier must be an int >= 0 (tier t keeps h >> t FFN units), "
                f"got {tier!r}."
            )
    if len(set(tiers)) != len(tiers):
        raise ValueError(f"{owner}(tiers={tiers!r}): tiers must be distinct; drop the duplicates.")
    return tiers


def _validate_limit(owner: str, limit_batches: Any) -> None:
    if limit_batches is None:
        return
    if isinstance(limit_batches, bool) or not isinstance(limit_batches, int) or limit_batches < 1:
        raise ValueError(
            f"{owner}(limit_batches={limit_batches!r}): use a positive int, or None for the number of batches "
            "Lightning's validation loop uses."
        )


def _max_tier(blocks: Sequence[FFNBlock]) -> int:
    """The largest tier every FFN's full size is divisible by (each tier must halve every FFN exactly)."""
    tier = 0
    while all(block.full_size % (1 << (tier + 1)) == 0 for block in blocks):
        tier += 1
    return tier


def default_tiers(model: nn.Module, cap: int = DEFAULT_MAX_TIER) -> list[int]:
    """Tiers ``0..max`` where ``max`` is the highest tier the FFN sizes of ``model`` divide into, capped at ``cap``."""
    return list(range(min(cap, _max_tier(find_ffns(model))) + 1))


def _check_tiers_fit(owner: str, model: nn.Module, tiers: Sequence[int]) -> None:
    """Raise a ``ValueError`` naming ``owner``'s ``tiers`` if the FFNs of ``model`` cannot run one of them."""
    blocks = find_ffns(model)  # raises UnsupportedModelError naming the supported families
    sizes = sorted({block.full_size for block in blocks})
    highest = _max_tier(blocks)
    for tier in tiers:
        if tier > highest:
            raise ValueError(
                f"{owner}(tiers={list(tiers)}): tier {tier} needs every FFN size ({sizes}) to be divisible by "
                f"2**{tier} = {1 << tier}; this model supports tiers 0..{highest}. Drop tier {tier}."
            )
        for block in blocks:
            if block.full_size >> tier > block.width:
                raise ValueError(
                    f"{owner}(tiers={list(tiers)}): FFN {block.path} is already sliced to width {block.width} (full "
                    f"{block.full_size}), so it cannot run tier {tier} (width {block.full_size >> tier}). Use the "
                    "full-width model, or drop the lower tiers."
                )


def _runnable(blocks: Sequence[FFNBlock], tier: int) -> bool:
    """Whether a (possibly sliced) model still holds every FFN unit that ``tier`` needs."""
    return all(block.full_size >> tier <= block.width for block in blocks)


def find_hf_model(module: nn.Module, owner: str = "TierExport") -> PreTrainedModel:
    """The Hugging Face model inside a LightningModule: ``module.model`` if it is one, else the first one found.

    Args:
        module: A LightningModule (or any ``nn.Module``), or an HF model itself.
        owner: Name used in the error message.

    Raises:
        ValueError: ``module`` holds no ``PreTrainedModel``.
    """
    model = getattr(module, "model", None)
    if isinstance(model, PreTrainedModel):
        return model
    for _, submodule in module.named_modules():  # pre-order: the outermost HF model comes first
        if isinstance(submodule, PreTrainedModel):
            return submodule
    raise ValueError(
        f"{owner} needs a Hugging Face PreTrainedModel inside {type(module).__name__} (as `.model` or any "
        "submodule), but found none. Build the model in __init__ or configure_model as an HF PreTrainedModel."
    )


# --------------------------------------------------------------------------------------------------- sampler
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
            - class_path: lightning_hetero.callbacks.MatFormerSampler
              init_args: {tiers: [0, 1, 2, 3], rule: sandwich, seed: 0}
    """

    def __init__(self, tiers: list[int] = [0, 1, 2, 3], rule: str = "random", seed: int = 0) -> None:  # noqa: B006
        self.tiers = _validate_tiers("MatFormerSampler", tiers)
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
        if _is_tiered(trainer):
            raise RuntimeError(
                f"MatFormerSampler samples a granularity per step in one process, but the strategy "
                f"{type(trainer.strategy).__name__} is tiered (this rank trains tier {strategy_tier(trainer)}): each "
                "rank already trains its fixed tier. Remove MatFormerSampler from the callbacks, or use a non-tiered "
                "strategy."
            )
        _check_tiers_fit("MatFormerSampler", pl_module, self.tiers)
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


# ------------------------------------------------------------------------------------------------ evaluation
class TierEvaluation(Callback):
    """After every validation epoch, evaluate validation loss and perplexity of each tier and log them.

    Lightning's own validation loop has just run at full width (it logs ``val/loss``); this callback then runs the
    datamodule's validation loader once per tier under ``torch.no_grad()`` and ``tier_view(pl_module, tier)`` (in
    eval mode, in the precision plugin's forward context) and logs ``val/loss_tier{t}`` and
    ``val/perplexity_tier{t} = exp(val/loss_tier{t})``. The loss is ``forward(**batch).loss`` averaged over batches
    weighted by batch size, like the ``val/loss`` of our modules, so ``val/loss_tier0`` equals ``val/loss`` on the
    same batches. It is skipped during the sanity check. ``results`` holds the latest values, tier -> dict.

    Which batches: the first ``limit_batches`` of ``trainer.datamodule.val_dataloader()`` (of Lightning's validation
    loader when there is no datamodule). ``limit_batches=None`` uses the number of batches Lightning's validation
    loop used (``trainer.num_val_batches``, i.e. ``limit_val_batches``), which are the same batches on one process.

    Processes: with a tiered strategy (``trainer.strategy`` has a ``tier``), a rank at tier ``t`` can only run tiers
    ``>= t``, so only global rank 0 (tier 0, the full model) evaluates and logs, with ``rank_zero_only=True``; the
    other ranks skip. Do not monitor these metrics with ``ModelCheckpoint``/``EarlyStopping`` there (only rank 0 has
    them). With any other strategy every rank evaluates the whole (unsharded) loader, so sharded forwards work, and
    logs without syncing (the values are equal). A tier the local model can no longer run (sliced narrower) is
    skipped with a warning.

    Args:
        tiers: Tiers to evaluate. None: ``0..max``, the highest tier the FFN sizes divide into, capped at 3.
        limit_batches: Evaluate at most this many batches per tier (None: as many as Lightning's validation loop).
    """

    def __init__(self, tiers: list[int] | None = None, limit_batches: int | None = None) -> None:
        self.tiers = None if tiers is None else _validate_tiers("TierEvaluation", tiers)
        _validate_limit("TierEvaluation", limit_batches)
        self.limit_batches = limit_batches
        self.results: dict[int, dict[str, float]] = {}
        self._checked = False
        self._warned: set[int] = set()

    def resolve_tiers(self, pl_module: nn.Module) -> list[int]:
        """The tiers to evaluate for this model (``tiers``, or the default ``0..min(3, max)``)."""
        return list(self.tiers) if self.tiers is not None else default_tiers(pl_module)

    def _check(self, pl_module: LightningModule) -> None:
        if not self._checked and self.tiers is not None:
            _check_tiers_fit("TierEvaluation", pl_module, self.tiers)
        self._checked = True

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not _is_tiered(trainer) or trainer.global_rank == 0:
            self._check(pl_module)

    def _limit(self, trainer: Trainer) -> int | None:
        if self.limit_batches is not None:
            return self.limit_batches
        counts = trainer.num_val_batches
        if not counts or not math.isfinite(counts[0]):
            return None
        return int(counts[0])

    @staticmethod
    def _loader(trainer: Trainer) -> Iterable[Any]:
        datamodule = trainer.datamodule
        if datamodule is not None:
            return datamodule.val_dataloader()
        loaders = trainer.val_dataloaders
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if loaders else None
        if loaders is None:
            raise RuntimeError("TierEvaluation needs a validation loader: pass a datamodule or val_dataloaders.")
        return loaders

    def evaluate(self, trainer: Trainer, pl_module: LightningModule, tier: int, limit: int | None = None) -> float:
        """Mean validation loss of ``pl_module`` at ``tier`` over the first ``limit`` validation batches.

        Args:
            trainer: The Trainer (for the loader, the device transfer and the precision context).
            pl_module: The module; ``forward(**batch)`` must return an object with ``.loss``.
            tier: Tier to run.
            limit: Number of batches (None: all).
        """
        with tier_view(pl_module, tier):
            return mean_validation_loss(trainer, pl_module, self._loader(trainer), limit, "TierEvaluation")

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        tiered = _is_tiered(trainer)
        if tiered and trainer.global_rank != 0:
            return  # only global rank 0 holds the full model, so only it can run every tier
        self._check(pl_module)
        blocks = find_ffns(pl_module)
        limit = self._limit(trainer)
        self.results = {}
        for tier in self.resolve_tiers(pl_module):
            if not _runnable(blocks, tier):
                if tier not in self._warned:
                    self._warned.add(tier)
                    rank_zero_warn(
                        f"TierEvaluation: this process holds a model sliced narrower than tier {tier} (strategy tier "
                        f"{strategy_tier(trainer)}); skipping tier {tier}."
                    )
                continue
            loss = self.evaluate(trainer, pl_module, tier, limit)
            perplexity = math.exp(min(loss, 80.0))
            self.results[tier] = {"loss": loss, "perplexity": perplexity}
            for name, value in (("loss", loss), ("perplexity", perplexity)):
                pl_module.log(
                    f"val/{name}_tier{tier}",
                    value,
                    on_step=False,
                    on_epoch=True,
                    sync_dist=False,
                    rank_zero_only=tiered,
                    batch_size=1,
                )


# ---------------------------------------------------------------------------------------------------- export
class TierExport(Callback):
    """When ``fit`` ends, write each tier as a standard Hugging Face checkpoint under ``dirpath/tier{t}``.

    The HF model is ``pl_module.model`` when it is a ``PreTrainedModel``, else the first ``PreTrainedModel``
    submodule. Each directory is what ``export_tier`` writes (``model.safetensors``, ``config.json`` with the
    reduced FFN size, ``generation_config.json``), plus the datamodule's ``tokenizer`` when it has one and
    ``save_tokenizer`` is True; plain ``AutoModel*.from_pretrained(dirpath/tier{t})`` loads it. The paths are printed
    (rank-zero info) and kept in ``exported`` (tier -> path).

    Only global rank 0 exports: under a tiered strategy it is the rank holding the full (tier-0) model, and under
    data parallelism every rank holds the same weights. The model is checked when fit starts (an HF model is found,
    its FFNs support every tier, the parameters are not sharded DTensors), so a bad setup fails before training.
    Nothing is exported when fit fails.

    Args:
        dirpath: Output root; ``tier{t}`` subdirectories are created (files in them are overwritten).
        tiers: Tiers to export. None: ``0..max``, the highest tier the FFN sizes divide into, capped at 3.
        save_tokenizer: Also save ``trainer.datamodule.tokenizer`` (when present) into every tier directory.
    """

    def __init__(self, dirpath: str, tiers: list[int] | None = None, save_tokenizer: bool = True) -> None:
        if not isinstance(dirpath, (str, os.PathLike)) or not str(dirpath).strip():
            raise ValueError(f"TierExport(dirpath={dirpath!r}): pass an output directory, e.g. 'outputs/tiers'.")
        if not isinstance(save_tokenizer, bool):
            raise ValueError(f"TierExport(save_tokenizer={save_tokenizer!r}): use True or False.")
        self.dirpath = Path(dirpath)
        self.tiers = None if tiers is None else _validate_tiers("TierExport", tiers)
        self.save_tokenizer = save_tokenizer
        self.exported: dict[int, Path] = {}

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        model = find_hf_model(pl_module, "TierExport")
        sharded = [name for name, param in model.named_parameters() if type(param).__name__ == "DTensor"]
        if sharded:
            raise RuntimeError(
                f"TierExport needs the full weights on global rank 0, but {len(sharded)} parameters (e.g. "
                f"{sharded[0]}) are sharded DTensors under {type(trainer.strategy).__name__}. Export from a "
                "consolidated checkpoint with lightning_hetero.matformer.export.export_tier instead."
            )
        if self.tiers is not None:
            _check_tiers_fit("TierExport", model, self.tiers)

    def _tokenizer(self, trainer: Trainer) -> Any | None:
        if not self.save_tokenizer or trainer.datamodule is None:
            return None
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
            rank_zero_warn(
                f"TierExport: the datamodule's tokenizer ({type(tokenizer).__name__}) has no "
                "save_pretrained; exporting without it."
            )
            return None
        return tokenizer

    def export(self, trainer: Trainer, pl_module: LightningModule) -> dict[int, Path]:
        """Export every tier now (what ``on_fit_end`` does on global rank 0) and return tier -> directory."""
        model = find_hf_model(pl_module, "TierExport")
        tiers = list(self.tiers) if self.tiers is not None else default_tiers(model)
        tokenizer = self._tokenizer(trainer)
        blocks = find_ffns(model)
        params = dict(model.named_parameters())
        total = sum(param.numel() for param in {id(p): p for p in model.parameters()}.values())
        for tier in tiers:
            path = export_tier(model, tier, self.dirpath / f"tier{tier}", tokenizer=tokenizer)
            removed = 0
            for block in blocks:
                width = block.full_size >> tier
                for spec in block.parameters:
                    param = params[spec.name]
                    removed += param.numel() // param.shape[spec.axis] * (param.shape[spec.axis] - width)
            self.exported[tier] = path
            rank_zero_info(
                f"[TierExport] tier {tier} (FFN width {blocks[0].full_size >> tier}, {total - removed:,} parameters) "
                f"-> {path}"
            )
        return dict(self.exported)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            self.export(trainer, pl_module)
