"""Greedy layerwise training for any LightningModule and plain ``Trainer``: :class:`GreedyLayerwise`.

The algorithm lives in :mod:`lightning_hetero.layerwise` (block split, auxiliary heads, activation cache, stage
logic); this callback wires it into the Trainer:

- it splits the model found inside the LightningModule when the Trainer builds the optimizers (after
  ``configure_model``), and replaces the module's ``training_step`` by the current stage's loss (logged as
  ``layerwise/loss`` with ``layerwise/stage``);
- the module's own ``configure_optimizers`` builds every stage's optimizer: the callback calls it again at each stage
  change (``trainer.strategy.setup_optimizers``) and keeps exactly the stage's parameters in it (frozen ones out, the
  auxiliary head's in, added to the group holding the block). With ``schedule_per_stage`` the module sees the stage's
  length as the run's ``max_steps`` while it builds its schedule, so a warmup + cosine schedule spans one stage;
- its checkpoint state holds the stage, where it started, the split's signature and the auxiliary heads; resuming
  under another split raises :class:`~lightning_hetero.layerwise.greedy.SplitMismatchError` before step 1;
- ``export_dir``: after fit, the model is saved with ``save_pretrained`` (auxiliary heads dropped, or the last one
  copied into the model's head with ``keep_last_aux_head``).
- under Lightning's DDP (``strategy="ddp"``, the default ``find_unused_parameters=False`` included) the callback
  re-wraps the module in ``DistributedDataParallel`` whenever a stage starts, with exactly the stage's parameters
  requiring grad (the frozen prefix, the later blocks and any parameter of the module outside the split do not), so
  DDP syncs only what the stage trains and never meets an unused parameter. The auxiliary heads live in the callback,
  not in the module: they are broadcast from rank 0 when a stage starts and their gradients are averaged over the
  ranks before each optimizer step, so every rank holds the same heads.

Validation and test keep the module's own steps (the whole model with its own head).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_hetero import comm
from lightning_hetero.core import average_gradients, broadcast_module_state
from lightning_hetero.layerwise import ActivationCache, GreedyStages, split_into_blocks

__all__ = ["GreedyLayerwise"]


class GreedyLayerwise(Callback):
    """Train the model block by block, each through its own auxiliary head, then freeze it and move on.

    Args:
        stage_steps: Optimizer steps per stage: one int for every stage, or one per block.
        num_blocks: Group the model's layers (CNN: conv stages) into this many blocks (default: one per layer).
        boundaries: Layer indices at which blocks 1.. start (instead of ``num_blocks``).
        aux_head: ``"linear"``, ``"mlp"`` or (causal LMs) ``"lm_head"``: final norm + LM head tied to the embedding.
        keep_last_aux_head: Train the last block through an auxiliary head too and export it as the model's head.
        cache: ``None``, ``"memory"`` or ``"disk"``: cache the frozen prefix's output per sample, so later stages
            pay only for their own block. Keyed by ``batch[index_key]`` when the loader yields it, else by a hash
            of each sample's inputs; exact either way.
        cache_dir: Directory of the disk cache (cleared at fit start).
        cache_max_bytes: Bound on cached bytes; past it samples are recomputed (logged once).
        index_key: Batch entry holding the dataset index of each sample (optional).
        schedule_per_stage: Let the module's learning-rate schedule span one stage (see the module docstring).
        export_dir: ``save_pretrained`` the model there after fit (HF models; others: ``model.pt`` state dict).
    """

    def __init__(
        self,
        stage_steps: int | Sequence[int] = 100,
        num_blocks: int | None = None,
        boundaries: Sequence[int] | None = None,
        aux_head: str = "linear",
        keep_last_aux_head: bool = False,
        cache: str | None = None,
        cache_dir: str | None = None,
        cache_max_bytes: int | None = None,
        index_key: str = "index",
        schedule_per_stage: bool = True,
        export_dir: str | None = None,
    ) -> None:
        steps = [stage_steps] if isinstance(stage_steps, int) else list(stage_steps)
        if not steps or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in steps):
            raise ValueError(f"stage_steps={stage_steps!r} must be a positive int or a list of positive ints.")
        self.stage_steps = steps
        self.split_args = {"num_blocks": num_blocks, "boundaries": list(boundaries) if boundaries else None}
        self.aux_head, self.keep_last_aux_head = aux_head, keep_last_aux_head
        self.cache = ActivationCache(cache, cache_max_bytes, cache_dir) if cache is not None else None
        self.index_key, self.schedule_per_stage, self.export_dir = index_key, schedule_per_stage, export_dir
        self.stages: GreedyStages | None = None
        self.stage_start_step = 0
        self._pending_state: dict[str, Any] | None = None
        self._patched: dict[str, Any] = {}
        self._trainer: pl.Trainer | None = None
        self._outside: list[torch.nn.Parameter] = []  # module parameters outside the split, frozen during fit
        self._ddp: tuple[int, int] | None = None  # (id of the DDP wrapper we built, the stage it was built for)

    # ------------------------------------------------------------------------------------------------ building
    def steps_of(self, stage: int) -> int:
        return self.stage_steps[stage] if len(self.stage_steps) > 1 else self.stage_steps[0]

    def _build(self, pl_module: pl.LightningModule) -> GreedyStages:
        if self.stages is not None:
            return self.stages
        stack = split_into_blocks(pl_module, **self.split_args)
        if len(self.stage_steps) not in (1, stack.num_blocks):
            raise ValueError(
                f"stage_steps has {len(self.stage_steps)} entries but the split has {stack.num_blocks} blocks "
                f"({stack.signature}); give one int or {stack.num_blocks} ints."
            )
        self.stages = GreedyStages(stack, self.aux_head, None, self.keep_last_aux_head, self.cache, self.index_key)
        if self._pending_state is not None:
            self.stages.load_state_dict(self._pending_state["stages"])
            self.stage_start_step = int(self._pending_state["stage_start_step"])
            self._pending_state = None
        return self.stages

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        original_configure, original_step = pl_module.configure_optimizers, pl_module.training_step
        self._patched = {"configure_optimizers": original_configure, "training_step": original_step}

        def configure_optimizers() -> Any:
            stages = self._build(pl_module)
            self._freeze_outside(pl_module)
            self._wrap_ddp_for_stage(trainer, pl_module)
            with self._stage_length_as_max_steps(trainer, self.steps_of(stages.stage)):
                result = original_configure()
            _restrict_optimizers(result, stages.active_parameters())
            return result

        def training_step(batch: Any, batch_idx: int) -> torch.Tensor:
            stages = self._build(pl_module)
            batch = stages.stack.as_batch(batch)  # a plain module's (x, y) pair works too
            loss = stages.stage_loss(batch)
            pl_module.log("layerwise/loss", loss, prog_bar=True, batch_size=_rows(batch))
            pl_module.log("layerwise/stage", float(stages.stage), batch_size=_rows(batch))
            return loss

        pl_module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
        pl_module.training_step = training_step  # type: ignore[method-assign]
        if self.cache is not None:
            self.cache.clear()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name in self._patched:
            pl_module.__dict__.pop(name, None)  # the class' own methods show through again
        self._patched = {}
        self._unfreeze_outside()
        self._ddp = None

    # ------------------------------------------------------------------------------------------------ DDP
    def _freeze_outside(self, pl_module: pl.LightningModule) -> None:
        """Stop parameters of the module that no stage trains (outside the split) from requiring grad during fit:
        the stage loss never reaches them, and DDP would report them as unused."""
        assert self.stages is not None
        inside = {id(p) for p in self.stages.all_parameters()}
        for parameter in pl_module.parameters():
            if id(parameter) not in inside and parameter.requires_grad:
                parameter.requires_grad_(False)
                self._outside.append(parameter)

    def _unfreeze_outside(self) -> None:
        for parameter in self._outside:
            parameter.requires_grad_(True)
        self._outside = []

    @staticmethod
    def _ddp_strategy(trainer: pl.Trainer) -> DDPStrategy | None:
        strategy = trainer.strategy
        if isinstance(strategy, DDPStrategy) and isinstance(strategy.model, DistributedDataParallel):
            return strategy
        return None

    def _wrap_ddp_for_stage(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Under DDP: wrap the module again for the current stage (DDP fixes the parameters it syncs when it is built:
        those requiring grad then), and give every rank rank 0's auxiliary heads."""
        strategy = self._ddp_strategy(trainer)
        assert self.stages is not None
        if strategy is None or self._ddp == (id(strategy.model), self.stages.stage):
            return
        strategy.model = pl_module
        strategy.configure_ddp()  # Lightning's own wrapping: its DDP arguments and communication hooks apply
        self._ddp = (id(strategy.model), self.stages.stage)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.stages.aux_heads.to(self.stages.stack.device)  # built before the model moved (a resume): NCCL
            broadcast_module_state(self.stages.aux_heads, 0, label=comm.INTRA)

    def _aux_parameters_in_training(self, pl_module: pl.LightningModule) -> list[torch.nn.Parameter]:
        assert self.stages is not None
        in_module = {id(p) for p in pl_module.parameters()}
        return [p for p in self.stages.active_parameters() if id(p) not in in_module]

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # DDP averages what the module holds; the auxiliary head lives here, so its gradients are averaged here.
        if self.stages is None or self._ddp_strategy(trainer) is None or trainer.world_size < 2:
            return
        aux = self._aux_parameters_in_training(pl_module)
        if aux:
            average_gradients(aux, None, comm.INTRA)

    @contextlib.contextmanager
    def _stage_length_as_max_steps(self, trainer: pl.Trainer, steps: int) -> Iterator[None]:
        if not self.schedule_per_stage:
            yield
            return
        epoch_loop = trainer.fit_loop.epoch_loop
        saved = epoch_loop.max_steps
        epoch_loop.max_steps = steps
        try:
            yield
        finally:
            epoch_loop.max_steps = saved

    # ------------------------------------------------------------------------------------------------ training
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stages = self._build(pl_module)
        device = stages.stack.device
        stages.aux_heads.to(device)
        total = sum(self.steps_of(j) for j in range(stages.num_stages))
        if trainer.max_steps not in (-1, total):
            rank_zero_warn(
                f"GreedyLayerwise: the stages add up to {total} steps but Trainer(max_steps={trainer.max_steps}); the "
                f"last stage {'continues' if trainer.max_steps > total else 'is cut short'}. Set max_steps={total}."
            )
        rank_zero_info(f"GreedyLayerwise: split {stages.stack.signature}, starting at stage {stages.stage}.")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        stages = self._build(pl_module)
        advanced = False
        while stages.stage < stages.num_stages - 1 and trainer.global_step - self.stage_start_step >= self.steps_of(
            stages.stage
        ):
            self.stage_start_step += self.steps_of(stages.stage)
            stages.enter_stage(stages.stage + 1)
            advanced = True
        if advanced:
            trainer.strategy.setup_optimizers(trainer)  # calls the module's configure_optimizers for the new stage
            rank_zero_info(f"GreedyLayerwise: stage {stages.stage} from step {trainer.global_step}.")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stages is None:
            return
        root = self.stages.export_()
        self._unfreeze_outside()
        if self.export_dir is not None and trainer.is_global_zero:
            if hasattr(root, "save_pretrained"):
                root.save_pretrained(self.export_dir)
            else:
                from pathlib import Path

                Path(self.export_dir).mkdir(parents=True, exist_ok=True)
                torch.save(root.state_dict(), Path(self.export_dir) / "model.pt")

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.stages is None:
            return {}
        return {"stages": self.stages.state_dict(), "stage_start_step": self.stage_start_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._pending_state = dict(state_dict)
        if self._trainer is not None and self._trainer.lightning_module is not None:
            self._build(self._trainer.lightning_module)  # a split mismatch fails here, before the optimizers exist


def _rows(batch: Any) -> int:
    labels = batch.get("labels") if isinstance(batch, dict) else None
    return int(labels.shape[0]) if labels is not None else 1


def _optimizers_in(result: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in any return value ``configure_optimizers`` may have."""
    if isinstance(result, torch.optim.Optimizer):
        return [result]
    if isinstance(result, dict):
        return _optimizers_in(result.get("optimizer"))
    if isinstance(result, (list, tuple)):
        return [opt for item in result for opt in _optimizers_in(item)]
    return []


def _restrict_optimizers(result: Any, active: list[torch.nn.Parameter]) -> None:
    """Keep exactly ``active`` in the (fresh, stateless) optimizers: drop the others, add the missing ones to the
    group that holds most of the active ones (its learning rate, decay and schedule apply)."""
    optimizers = _optimizers_in(result)
    if len(optimizers) != 1:
        raise ValueError(
            f"GreedyLayerwise needs configure_optimizers to return exactly one optimizer, got {len(optimizers)}."
        )
    optimizer = optimizers[0]
    wanted = {id(p) for p in active}
    present: set[int] = set()
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in wanted]
        present.update(id(p) for p in group["params"])
    target = max(optimizer.param_groups, key=lambda g: len(g["params"]))
    target["params"].extend(p for p in active if id(p) not in present)
