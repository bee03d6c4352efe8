"""The loop-independent core of the subspace pipeline strategies, shared by the Trainer and Fabric adapters.

:class:`SubspacePipelineRuntime` takes the strategy's settings
(:class:`~lightning_hetero.subspace_pipeline.settings.SubspacePipelineSettings`, which check themselves), finds the
user's HF decoder, builds this rank's stage (:func:`lightning_hetero.subspace_pipeline.stages.build_stages`) and puts it
where the HF model was, and runs one training or evaluation step over the schedule
(:class:`~lightning_hetero.subspace_pipeline.pipeline.PipelineExecutor`). Around
the schedule it does what a pipeline needs on every step: the loss broadcast from the last stage, the replicas'
gradient average, gradient projection (``mode="projected"``), the pipeline-wide clipping norm and the periodic
subspace update (statistic summed over all ranks, basis proposed on rank 0, broadcast, every stage rebased). It also
names the checkpoint parts and writes/checks ``meta.json`` (:mod:`lightning_hetero.subspace_pipeline.checkpoint`) and
gathers the stages for the dense export.
:mod:`lightning_hetero.strategies.subspace_pipeline.trainer` (Trainer) and
:mod:`lightning_hetero.strategies.subspace_pipeline.fabric` (Fabric) only decide
*when* each piece runs. Nothing here imports Lightning.

Ledger labels: boundary messages, the loss broadcast, the clipping norm and the subspace update use
:data:`~lightning_hetero.comm.PIPELINE` (they all cross stage links); the replicas' gradient average uses
:data:`~lightning_hetero.comm.INTRA` (the rank layout keeps a stage's replicas on one node); gathering stages for
export uses ``"export"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hetero import comm
from lightning_hetero.core import (
    StrategyRuntime,
    average_gradients,
    broadcast_module_state,
    clip_grad_norm_over_group,
)
from lightning_hetero.pipeline.layout import PipelineGroups, PipelineLayout, PipelinePlacement, split_layers
from lightning_hetero.pipeline.stage_gather import gather_stage_states, stage_bytes_limit
from lightning_hetero.pipeline.stage_holder import find_stage_holder
from lightning_hetero.subspace_pipeline import checkpoint as ckpt
from lightning_hetero.subspace_pipeline.container import PipelineStageModel, hollow_into, locate_decoder
from lightning_hetero.subspace_pipeline.pipeline import (
    PipelineExecutor,
    shifted_ce_sum,
    split_batch,
    valid_tokens,
)
from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings

__all__ = ["SubspacePipelineRuntime"]

DP_LABEL = comm.INTRA
"""Ledger label of the replicas' gradient average (one stage's replicas share a node in the rank layout)."""


class SubspacePipelineRuntime(PipelinePlacement, StrategyRuntime):
    """The loop-independent part of the subspace pipeline, shared by the Trainer and Fabric strategies.

    Args:
        settings: The strategy's settings (see
            :class:`~lightning_hetero.subspace_pipeline.settings.SubspacePipelineSettings`; checked there).
        owner: Class name used in error messages.
    """

    checkpoint_key = "subspace_pipeline"
    directory_checkpoint = True  # one part per stage (written by replica 0) plus meta.json
    restore_after_setup = True

    settings: SubspacePipelineSettings

    def __init__(self, settings: SubspacePipelineSettings, owner: str = "SubspacePipelineStrategy") -> None:
        from lightning_hetero.subspace_pipeline.basis import SubspaceConfig

        self._attach_settings(settings, SubspacePipelineSettings, owner)
        self.config = SubspaceConfig(
            subspace_dim=settings.subspace_dim,
            dim_ratio=settings.resolved_dim_ratio(),
            seed=settings.seed,
            mode=settings.mode,
            compress=settings.compress,
            coord_dtype=settings.pipeline.boundary_dtype,
            update_every=settings.update_every,
            update_lr=settings.update_lr,
        )
        self.layout = PipelineLayout(settings.pipeline.num_stages, settings.pipeline.data_parallel_size)
        self.groups: PipelineGroups | None = None
        self.executor: PipelineExecutor | None = None
        self.container: PipelineStageModel | None = None
        self.layer_ranges: list[tuple[int, int]] | None = None
        self.subspace_updates = 0
        """Number of subspace updates applied so far (checkpointed with the stage)."""
        self.steps = 0
        """Optimizer steps done (drives ``update_every``; checkpointed with the stage)."""

    # ------------------------------------------------------------------------------------------------ topology
    @property
    def stage(self) -> nn.Module:
        """This rank's stage module (after :meth:`setup`)."""
        if self.container is None:
            raise self._not_set_up()
        return self.container.stage

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
        existing = find_stage_holder(module, PipelineStageModel)
        if existing is not None:
            self._check_holder(existing)
            self.container = existing
            layers = int(existing.config.num_hidden_layers)
            self.layer_ranges = [tuple(r) for r in split_layers(layers, self.num_stages)]
            self.executor = PipelineExecutor(existing.stage, self.groups, self.settings.schedule)
            return module
        from lightning_hetero.subspace_pipeline.stages import build_stages

        parent, attribute, hf_model = locate_decoder(module)
        num_layers = int(hf_model.config.num_hidden_layers)
        if num_layers < self.num_stages:
            raise ValueError(
                f"{self.owner}: settings.pipeline.num_stages={self.num_stages}, but the model has only {num_layers} "
                f"decoder layers; use at most {num_layers} stages."
            )
        self.check_width(int(hf_model.config.hidden_size))
        self.layer_ranges = [tuple(r) for r in split_layers(num_layers, self.num_stages)]
        # release_unused: the rest of the HF model (other stages' layers) becomes meta tensors, freeing its memory.
        stage = build_stages(hf_model, self.config, self.num_stages, [self.stage_index], release_unused=True)[0]
        stage = stage.to(device)
        self.container = PipelineStageModel(stage, hf_model.config, self.stage_index, self.num_stages)
        self._sync_replicas()
        self.executor = PipelineExecutor(stage, self.groups, self.settings.schedule)
        if parent is None:
            hollow_into(module, self.container)
        else:
            setattr(parent, attribute, self.container)
        return module

    def check_width(self, hidden_size: int) -> None:
        """Raise a ValueError naming the setting unless the subspace fits a model of width ``hidden_size`` (``d``).

        Only the model tells ``d``, so this runs at setup; :meth:`SubspaceConfig.resolve_rank` would raise too, but
        under the algorithm config's own field names.
        """
        settings = self.settings
        if not settings.compress:
            return
        if settings.subspace_dim is not None and settings.subspace_dim > hidden_size:
            raise ValueError(
                f"{self.owner}: settings.subspace_dim={settings.subspace_dim} exceeds the model width d={hidden_size}; "
                f"use subspace_dim <= {hidden_size}."
            )
        ratio = settings.resolved_dim_ratio()
        if ratio is not None and round(hidden_size / ratio) < 1:
            raise ValueError(
                f"{self.owner}: settings.dim_ratio={ratio} leaves k = round({hidden_size} / {ratio}) = 0 coordinates "
                f"per token; use dim_ratio <= {hidden_size}."
            )

    def _sync_replicas(self) -> None:
        """Give every replica of this stage replica 0's weights (different seeds per rank must not fork them)."""
        groups = self._groups
        if self.data_parallel_size == 1 or groups.dp_group is None:
            return
        source = self.layout.global_rank(groups.stage, 0)
        broadcast_module_state(self.stage, source, group=groups.dp_group, label=DP_LABEL)

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
        chunks = split_batch(batch, self.settings.num_microbatches, self.owner)
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
        chunks = split_batch(batch, self.settings.num_microbatches, self.owner)
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
            raise self._not_set_up()
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
        average_gradients([p for p in self.stage.parameters() if p.requires_grad], groups.dp_group, DP_LABEL)

    def clip_grad_norm_(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip with the norm of the whole pipeline's gradient (every stage gets the same coefficient).

        Stages hold disjoint parameters, so the global ``p``-norm is the ``p``-th root of the sum over stages of
        local ``p``-th powers (the maximum for ``inf``); replicas hold equal (averaged) gradients, so the pipeline
        group suffices. Returns the total norm.
        """
        groups = self._groups
        grads = [p.grad.detach() for p in parameters if p.grad is not None]
        return clip_grad_norm_over_group(
            grads,
            max_norm,
            norm_type,
            groups.pipeline_group,
            comm.PIPELINE,
            error_if_nonfinite,
            reduce=groups.pipeline_group is not None and self.num_stages > 1,
            device=self.stage_device,
            owner=self.owner,
        )

    @property
    def stage_device(self) -> torch.device:
        """Device of the stage's first parameter or buffer (CPU when it has none)."""
        for tensor in list(self.stage.parameters()) + list(self.stage.buffers()):
            return tensor.device
        return torch.device("cpu")

    # ------------------------------------------------------------------------------------------------ subspace
    def after_optimizer_step(self, optimizer: Optimizer | None, steps_done: int) -> bool:
        """Run the subspace update when ``steps_done`` is a multiple of ``update_every``; True if it ran.

        Collective over the world: the statistic is summed over every rank, rank 0 proposes the new basis and
        broadcasts it, and every stage re-expresses its weights and optimizer moments in it.
        """
        self.steps = steps_done
        every = self.config.update_every
        if not (self.config.compress and every) or steps_done <= 0 or steps_done % every:
            return False
        from lightning_hetero.subspace_pipeline.basis import propose_basis

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

    def meta(self) -> dict[str, Any]:
        """What a checkpoint records about the pipeline (checked on resume)."""
        hf_config = self.container.config if self.container is not None else None
        hidden = getattr(hf_config, "hidden_size", None)
        rank = self.config.resolve_subspace_dim(hidden) if self.config.compress and hidden else None
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
            "schedule": self.settings.schedule,
            "n_microbatches": self.settings.num_microbatches,
            "model_type": getattr(hf_config, "model_type", None),
        }

    def extra_checkpoint_state(self, device: torch.device) -> dict[str, Any]:
        return {"steps": self.steps, "subspace_updates": self.subspace_updates}

    def load_extra_checkpoint_state(self, entry: Mapping[str, Any] | None) -> None:
        entry = entry or {}
        self.steps = int(entry.get("steps", 0))
        self.subspace_updates = int(entry.get("subspace_updates", 0))

    def checkpoint_part(self, global_rank: int) -> str | None:
        return ckpt.stage_file(".", self.stage_index).stem if self.dp_rank == 0 else None

    def checkpoint_part_to_load(self, global_rank: int) -> str:
        return ckpt.stage_file(".", self.stage_index).stem

    def write_checkpoint_meta(self, directory: Path) -> None:
        ckpt.write_meta(directory, self.meta())

    def check_checkpoint_meta(self, directory: Path) -> None:
        ckpt.check_meta(ckpt.read_meta(directory), self.meta(), directory)

    def gather_stage_states(self) -> list[dict[str, Tensor]] | None:
        """Every stage's ``state_dict`` (replica 0's), in stage order, on global rank 0; None elsewhere (collective)."""
        state = {k: v.detach().cpu() for k, v in self.stage.state_dict().items()}
        # Rank 0 bounds every announced stage size by what this model's stages can hold, before allocating.
        bound = (
            stage_bytes_limit(self.container.config) if self._groups.rank == 0 and self.container is not None else None
        )
        return gather_stage_states(state, self.layout, self._groups.rank, self.stage_device, max_bytes=bound)

    def export_dense(self, path: str, tokenizer: Any | None = None) -> str | None:
        """Write the whole pipeline as one plain HF checkpoint at ``path`` (collective; rank 0 writes).

        Returns ``path`` on global rank 0, None elsewhere.
        """
        states = self.gather_stage_states()
        if states is None:
            return None
        from lightning_hetero.subspace_pipeline.export import export_dense

        assert self.container is not None
        export_dense(states, self.container.config, path, tokenizer=tokenizer, subspace_config=self.config)
        return path
