"""The loop-independent core of the subspace pipeline strategies, shared by the Trainer and Fabric adapters.

:class:`SubspacePipelineRuntime` holds the knobs and their validation, finds the user's HF decoder, builds this rank's
stage (:func:`lightning_hetero.subspace.stages.build_stages`) and puts it where the HF model was, and runs one
training or evaluation step over the schedule (:class:`~lightning_hetero.subspace.pipeline.PipelineExecutor`). Around
the schedule it does what a pipeline needs on every step: the loss broadcast from the last stage, the replicas'
gradient average, gradient projection (``mode="projected"``), the pipeline-wide clipping norm and the periodic
subspace update (statistic summed over all ranks, basis proposed on rank 0, broadcast, every stage rebased).
:mod:`lightning_hetero.subspace.strategy` (Trainer) and :mod:`lightning_hetero.subspace.fabric` (Fabric) only decide
*when* each piece runs. Nothing here imports Lightning.

Ledger labels: boundary messages, the loss broadcast, the clipping norm and the subspace update use
:data:`~lightning_hetero.comm.PIPELINE` (they all cross stage links); the replicas' gradient average uses
:data:`~lightning_hetero.comm.INTRA` (the rank layout keeps a stage's replicas on one node); gathering stages for
export uses ``"export"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hetero import comm
from lightning_hetero.subspace.checkpoint import EXPORT_LABEL, gather_stage_states
from lightning_hetero.subspace.pipeline import (
    IGNORE_INDEX,
    PipelineExecutor,
    PipelineGroups,
    PipelineLayout,
    shifted_ce_sum,
    split_batch,
    valid_tokens,
)
from lightning_hetero.subspace.schedules import check_schedule

__all__ = ["EXPORT_LABEL", "IGNORE_INDEX", "PipelineStageModel", "SubspacePipelineRuntime", "split_batch"]

DEFAULT_COMPRESSION = 16.0
"""``d / k`` when neither ``rank`` nor ``compression`` is given (so ``strategy="subspace_pipeline"`` works)."""
DP_LABEL = comm.INTRA
"""Ledger label of the replicas' gradient average (one stage's replicas share a node in the rank layout)."""


class PipelineStageModel(nn.Module):
    """Takes the place of the user's HF model inside their module: holds only this rank's stage.

    Its parameters are the stage's, so ``configure_optimizers`` (``self.parameters()``) builds an optimizer over this
    rank's share of the model. Calling it directly is an error: the strategy drives the stage through the schedule.

    Args:
        stage: This rank's stage module.
        config: The HF config of the original model (kept for code that reads ``model.config``).
        stage_index: Index of the stage.
        num_stages: Number of stages.
    """

    def __init__(self, stage: nn.Module, config: Any, stage_index: int, num_stages: int) -> None:
        super().__init__()
        self.stage = stage
        self.config = config
        self.stage_index = stage_index
        self.num_stages = num_stages

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"This model is stage {self.stage_index} of a {self.num_stages}-stage SubspacePipelineStrategy pipeline; "
            "it cannot run on its own. The strategy runs the schedule for you (Trainer), or call "
            "strategy.train_step(batch) / strategy.eval_step(batch) (Fabric). Export the whole model with "
            "strategy.export_dense(path)."
        )


class SubspacePipelineRuntime:
    """The loop-independent part of the subspace pipeline, shared by the Trainer and Fabric strategies.

    Args:
        num_stages: Pipeline stages ``P`` (one per rank of a replica).
        rank: ``k``, coordinates per token at a boundary. Exclusive with ``compression``.
        compression: ``d / k`` instead of ``rank``. Neither given: ``compression=16``.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        n_microbatches: Microbatches per optimizer step (the batch must split evenly); default ``num_stages``.
        data_parallel_size: Replicated pipelines ``D``; stage gradients are averaged over the replicas.
        compress: False: the plain (unconstrained) model; boundaries carry ``d`` numbers.
        mode: ``"reparam"`` or ``"projected"`` (see :class:`~lightning_hetero.subspace.SubspaceConfig`).
        coord_dtype: Boundary codec: ``"fp32"``, ``"bf16"`` or ``"int8"`` (lossy).
        update_every: Optimizer steps between subspace updates (0: frozen U).
        update_lr: Step size of the subspace update.
        seed: Seed of U and T_fixed.
        owner: Class name used in error messages.
    """

    def __init__(
        self,
        num_stages: int,
        rank: int | None = None,
        compression: float | None = None,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        data_parallel_size: int = 1,
        compress: bool = True,
        mode: str = "reparam",
        coord_dtype: str = "fp32",
        update_every: int = 0,
        update_lr: float = 0.1,
        seed: int = 0,
        owner: str = "SubspacePipelineStrategy",
    ) -> None:
        from lightning_hetero.subspace.basis import SubspaceConfig

        self.owner = owner
        _check_int(owner, "num_stages", num_stages, 1)
        _check_int(owner, "data_parallel_size", data_parallel_size, 1)
        n_microbatches = num_stages if n_microbatches is None else n_microbatches
        _check_int(owner, "n_microbatches", n_microbatches, 1)
        _check_int(owner, "update_every", update_every, 0)
        _check_int(owner, "seed", seed, None)
        self.schedule = check_schedule(schedule, owner)
        if compress and rank is None and compression is None:
            compression = DEFAULT_COMPRESSION  # so that the bare registered name works
        try:
            self.config = SubspaceConfig(
                rank=rank,
                compression=compression,
                seed=seed,
                mode=mode,  # type: ignore[arg-type]
                compress=bool(compress),
                coord_dtype=coord_dtype,  # type: ignore[arg-type]
                update_every=update_every,
                update_lr=update_lr,
            )
        except (ValueError, TypeError) as error:
            raise ValueError(f"{owner}: {error}") from None
        if update_every and not compress:
            raise ValueError(f"{owner}(update_every={update_every}, compress=False): there is no subspace to update.")
        self.layout = PipelineLayout(num_stages, data_parallel_size)
        self.n_microbatches = n_microbatches
        self.groups: PipelineGroups | None = None
        self.executor: PipelineExecutor | None = None
        self.container: PipelineStageModel | None = None
        self.layer_ranges: list[tuple[int, int]] | None = None
        self.subspace_updates = 0
        """Number of subspace updates applied so far (checkpointed with the stage)."""

    # ------------------------------------------------------------------------------------------------ topology
    @property
    def num_stages(self) -> int:
        """``P``."""
        return self.layout.num_stages

    @property
    def data_parallel_size(self) -> int:
        """``D``."""
        return self.layout.data_parallel_size

    def resolve_world(self, world_size: int) -> None:
        """Check the world size against ``num_stages * data_parallel_size`` (raises before anything starts)."""
        self.layout.check_world(world_size, self.owner)

    @property
    def stage(self) -> nn.Module:
        """This rank's stage module (after :meth:`setup`)."""
        if self.container is None:
            raise RuntimeError(f"{self.owner}: the pipeline is not set up yet (the strategy does it in setup).")
        return self.container.stage

    @property
    def stage_index(self) -> int:
        """This rank's stage."""
        return self._groups.stage

    @property
    def dp_rank(self) -> int:
        """This rank's replica."""
        return self._groups.dp_rank

    @property
    def _groups(self) -> PipelineGroups:
        if self.groups is None:
            raise RuntimeError(f"{self.owner}: the pipeline is not set up yet (the strategy does it in setup).")
        return self.groups

    def sampler_kwargs(self, global_rank: int) -> dict[str, int]:
        """DistributedSampler arguments: every stage of a replica reads the same batches (shard by replica only)."""
        return {"num_replicas": self.data_parallel_size, "rank": self.layout.dp_rank_of(global_rank)}

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self, module: nn.Module, device: torch.device, global_rank: int) -> nn.Module:
        """Replace the HF decoder inside ``module`` by this rank's stage (collective when replicated).

        Idempotent: a module already set up keeps its stage (``validate`` after ``fit``).

        Args:
            module: The user's LightningModule (or the bare HF model, under Fabric).
            device: Where the stage lives.
            global_rank: This process's rank.

        Returns:
            ``module`` with the stage in place of the HF model. When ``module`` is the HF model itself (Fabric), it
            is hollowed out instead: its submodules are dropped and the stage container becomes its only child
            (``pipeline``), so wrappers holding a reference to it (Fabric's) see the stage's parameters and state.
        """
        if self.groups is None:
            self.groups = PipelineGroups(self.layout, global_rank)
        existing = _find_container(module)
        if existing is not None:
            from lightning_hetero.subspace.stages import split_layers

            if existing.num_stages != self.num_stages:
                raise ValueError(
                    f"{self.owner}(num_stages={self.num_stages}): the module already holds stage "
                    f"{existing.stage_index} of a {existing.num_stages}-stage pipeline."
                )
            self.container = existing
            layers = int(existing.config.num_hidden_layers)
            self.layer_ranges = [tuple(r) for r in split_layers(layers, self.num_stages)]
            self.executor = PipelineExecutor(existing.stage, self.groups, self.schedule)
            return module
        from lightning_hetero.subspace.stages import build_stages, split_layers

        parent, attribute, hf_model = locate_decoder(module)
        num_layers = int(hf_model.config.num_hidden_layers)
        if num_layers < self.num_stages:
            raise ValueError(
                f"{self.owner}(num_stages={self.num_stages}): the model has only {num_layers} decoder layers; use at "
                f"most {num_layers} stages."
            )
        self.layer_ranges = [tuple(r) for r in split_layers(num_layers, self.num_stages)]
        # release_unused: the rest of the HF model (other stages' layers) becomes meta tensors, freeing its memory.
        stage = build_stages(hf_model, self.config, self.num_stages, [self.stage_index], release_unused=True)[0]
        stage = stage.to(device)
        self.container = PipelineStageModel(stage, hf_model.config, self.stage_index, self.num_stages)
        self._sync_replicas()
        self.executor = PipelineExecutor(stage, self.groups, self.schedule)
        if parent is None:
            _hollow_into(module, self.container)
        else:
            setattr(parent, attribute, self.container)
        return module

    def _sync_replicas(self) -> None:
        """Give every replica of this stage replica 0's weights (different seeds per rank must not fork them)."""
        groups = self._groups
        if self.data_parallel_size == 1 or groups.dp_group is None:
            return
        source = self.layout.global_rank(groups.stage, 0)
        with torch.no_grad():
            for tensor in list(self.stage.parameters()) + list(self.stage.buffers()):
                comm.broadcast(tensor.data, source, label=DP_LABEL, group=groups.dp_group)

    # ------------------------------------------------------------------------------------------------ steps
    def _loss_fn(
        self, module: nn.Module | None, chunks: Sequence[Mapping[str, Tensor]]
    ) -> Callable[[Tensor, int], Tensor]:
        custom = getattr(module, "pipeline_loss", None) if module is not None else None
        if custom is not None:
            scale = 1.0 / len(chunks)
            return lambda logits, m: custom(logits, chunks[m]) * scale
        total = valid_tokens(chunks)
        return lambda logits, m: shifted_ce_sum(logits, chunks[m]["labels"]) / total

    def train_step(self, batch: Any, module: nn.Module | None = None) -> Tensor:
        """Forward and backward of every microbatch, then the post-backward work; returns the step's loss.

        Gradients land in the stage parameters' ``.grad`` (added to what is there), already averaged over the
        replicas and, in projected mode, projected onto the subspace. The loss (the mean token cross-entropy of the
        whole batch, or the mean over microbatches of ``module.pipeline_loss(logits, microbatch)`` when the module
        defines it) is computed on the last stage and broadcast, so every rank returns the same value.

        Args:
            batch: The batch (same on every stage of a replica).
            module: The user's module (looked up for a ``pipeline_loss`` override).
        """
        executor = self._executor
        chunks = split_batch(batch, self.n_microbatches, self.owner)
        tracking = self._start_tracking()
        losses = executor.train(chunks, self._loss_fn(module, chunks))
        loss = self._broadcast_loss(losses, chunks[0]["input_ids"].device)
        self.sync_data_parallel_gradients()
        if tracking:
            self._call_stage("accumulate_subspace_gradient_")
        if self.config.compress and self.config.mode == "projected":
            self._call_stage("project_gradients_")
        return loss

    @torch.no_grad()
    def eval_step(self, batch: Any, module: nn.Module | None = None) -> Tensor:
        """Forward-only pass over every microbatch; returns the batch loss on every rank (as in :meth:`train_step`)."""
        executor = self._executor
        chunks = split_batch(batch, self.n_microbatches, self.owner)
        custom = getattr(module, "pipeline_loss", None) if module is not None else None
        if custom is not None:
            scale = 1.0 / len(chunks)
            outputs = executor.forward_only(chunks, lambda logits, m: custom(logits, chunks[m]).detach() * scale)
        else:
            total = valid_tokens(chunks)
            outputs = executor.forward_only(
                chunks, lambda logits, m: shifted_ce_sum(logits, chunks[m]["labels"]) / total
            )
        return self._broadcast_loss(outputs, chunks[0]["input_ids"].device)

    @property
    def _executor(self) -> PipelineExecutor:
        if self.executor is None:
            raise RuntimeError(f"{self.owner}: the pipeline is not set up yet (the strategy does it in setup).")
        return self.executor

    def _broadcast_loss(self, losses: Sequence[Tensor], device: torch.device) -> Tensor:
        groups = self._groups
        value = torch.stack([loss.float() for loss in losses]).sum() if losses else torch.zeros((), device=device)
        value = value.detach().to(device=device, dtype=torch.float32).reshape(1).contiguous()
        if groups.pipeline_group is not None and self.num_stages > 1:
            comm.broadcast(value, groups.last_rank, label=comm.PIPELINE, group=groups.pipeline_group)
        return value[0]

    def _call_stage(self, name: str, *args: Any) -> Any:
        method = getattr(self.stage, name, None)
        if method is None:
            raise RuntimeError(f"{self.owner}: the stage module has no {name}(); the subspace core is too old.")
        return method(*args)

    def _start_tracking(self) -> bool:
        """Whether this step's gradients feed the subspace statistic (only with ``update_every > 0``; the stage's
        backward hooks record it while ``track_subspace_gradient`` is on, which the stage does by default then)."""
        return bool(self.config.compress and self.config.update_every)

    def sync_data_parallel_gradients(self) -> None:
        """Average the stage gradients over the replicas (one all-reduce per dtype; missing grads count as zeros)."""
        groups = self._groups
        if self.data_parallel_size == 1 or groups.dp_group is None:
            return
        params = [p for p in self.stage.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            by_dtype.setdefault(param.grad.dtype, []).append(param)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            comm.all_reduce(flat, "avg", label=DP_LABEL, group=groups.dp_group)
            offset = 0
            for param in group:
                count = param.grad.numel()
                param.grad.copy_(flat[offset : offset + count].view_as(param.grad))
                offset += count

    def clip_grad_norm_(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip with the norm of the whole pipeline's gradient (every stage gets the same coefficient).

        Stages hold disjoint parameters, so the global ``p``-norm is the ``p``-th root of the sum over stages of
        local ``p``-th powers (the maximum for ``inf``); replicas hold equal (averaged) gradients, so the pipeline
        group suffices. Returns the total norm.
        """
        params = [p for p in parameters if p.grad is not None]
        norm_type = float(norm_type)
        grads = [p.grad.detach() for p in params]
        device = grads[0].device if grads else self.stage_device
        if norm_type == math.inf:
            local = max((g.abs().max().float() for g in grads), default=torch.zeros((), device=device))
            total = torch.as_tensor(local, dtype=torch.float32, device=device).reshape(1).clone()
            self._pipeline_all_reduce(total, "max")
        else:
            local = sum((torch.linalg.vector_norm(g.float(), norm_type) ** norm_type for g in grads), torch.zeros(()))
            total = torch.as_tensor(local, dtype=torch.float32, device=device).reshape(1).clone()
            self._pipeline_all_reduce(total, "sum")
            total = total ** (1.0 / norm_type)
        norm = total[0]
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order {norm_type} of the pipeline's gradients is non-finite.")
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    @property
    def stage_device(self) -> torch.device:
        """Device of the stage's first parameter or buffer (CPU when it has none)."""
        for tensor in list(self.stage.parameters()) + list(self.stage.buffers()):
            return tensor.device
        return torch.device("cpu")

    def _pipeline_all_reduce(self, tensor: Tensor, op: str) -> None:
        groups = self._groups
        if groups.pipeline_group is not None and self.num_stages > 1:
            comm.all_reduce(tensor, op, label=comm.PIPELINE, group=groups.pipeline_group)

    # ------------------------------------------------------------------------------------------------ subspace
    def after_optimizer_step(self, optimizer: Optimizer | None, steps_done: int) -> bool:
        """Run the subspace update when ``steps_done`` is a multiple of ``update_every``; True if it ran.

        Collective over the world: the statistic is summed over every rank, rank 0 proposes the new basis and
        broadcasts it, and every stage re-expresses its weights and optimizer moments in it.
        """
        every = self.config.update_every
        if not (self.config.compress and every) or steps_done <= 0 or steps_done % every:
            return False
        from lightning_hetero.subspace.basis import propose_basis

        stage = self.stage
        statistic = stage.subspace_statistic.detach().to(torch.float32).contiguous().clone()
        comm.all_reduce(statistic, "sum", label=comm.PIPELINE)
        basis = stage.basis
        new_basis = torch.empty_like(basis)
        if self._groups.rank == 0:
            new_basis.copy_(propose_basis(basis, statistic.to(basis.device), self.config.update_lr))
        comm.broadcast(new_basis, 0, label=comm.PIPELINE)
        stage.rebase_(new_basis, optimizer)
        self.subspace_updates += 1
        return True

    # ------------------------------------------------------------------------------------------------ state
    def meta(self) -> dict[str, Any]:
        """What a checkpoint records about the pipeline (checked on resume)."""
        hf_config = self.container.config if self.container is not None else None
        hidden = getattr(hf_config, "hidden_size", None)
        rank = self.config.resolve_rank(hidden) if self.config.compress and hidden else None
        return {
            "num_stages": self.num_stages,
            "data_parallel_size": self.data_parallel_size,
            "layer_ranges": [list(r) for r in self.layer_ranges] if self.layer_ranges else None,
            "rank": rank,
            "compress": self.config.compress,
            "mode": self.config.mode,
            "seed": self.config.seed,
            "coord_dtype": self.config.coord_dtype,
            "update_every": self.config.update_every,
            "schedule": self.schedule,
            "n_microbatches": self.n_microbatches,
            "model_type": getattr(hf_config, "model_type", None),
        }

    def gather_stage_states(self) -> list[dict[str, Tensor]] | None:
        """Every stage's ``state_dict`` (replica 0's), in stage order, on global rank 0; None elsewhere (collective)."""
        state = {k: v.detach().cpu() for k, v in self.stage.state_dict().items()}
        return gather_stage_states(state, self.layout, self._groups.rank, self.stage_device)

    def export_dense(self, path: str, tokenizer: Any | None = None) -> str | None:
        """Write the whole pipeline as one plain HF checkpoint at ``path`` (collective; rank 0 writes).

        Returns ``path`` on global rank 0, None elsewhere.
        """
        states = self.gather_stage_states()
        if states is None:
            return None
        from lightning_hetero.subspace.export import export_dense

        assert self.container is not None
        export_dense(states, self.container.config, path, tokenizer=tokenizer, subspace_config=self.config)
        return path


# ---------------------------------------------------------------------------------------------------- helpers
def _check_int(owner: str, name: str, value: Any, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{owner}({name}={value!r}): use an int{bound}.")


def _hollow_into(module: nn.Module, container: PipelineStageModel) -> None:
    """Make ``container`` the only content of ``module`` (the bare HF model): its own modules, parameters and buffers
    go, its ``forward`` becomes the container's (which explains how to run the pipeline)."""
    for registry in (module._modules, module._parameters, module._buffers):
        registry.clear()
    module.pipeline = container
    module.forward = container.forward  # type: ignore[method-assign]


def _find_container(module: nn.Module) -> PipelineStageModel | None:
    if isinstance(module, PipelineStageModel):
        return module
    for sub in module.modules():
        if isinstance(sub, PipelineStageModel):
            return sub
    return None


def locate_decoder(module: nn.Module) -> tuple[nn.Module | None, str, nn.Module]:
    """``(parent, attribute, hf_model)``: the supported HF causal LM inside ``module`` and where it hangs.

    ``parent`` is None when ``module`` is the HF model itself.

    Raises:
        ValueError: No supported model inside (the subspace core's message names the supported families).
    """
    from lightning_hetero.subspace.model import find_decoder

    parts = find_decoder(module)
    if not parts.path:
        return None, "", parts.causal_lm
    parent_name, _, attribute = parts.path.rpartition(".")
    return module.get_submodule(parent_name), attribute, parts.causal_lm
