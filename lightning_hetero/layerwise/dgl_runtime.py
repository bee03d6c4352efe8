"""Decoupled greedy layerwise training (DGL) as a forward-only pipeline: the runtime behind ``strategy="layerwise"``.

Each rank runs one stage (stage-major layout, as the subspace pipeline: global rank ``r`` runs stage
``r // data_parallel_size`` of replica ``r % data_parallel_size``, so a stage's replicas share a node). A training
step on stage ``s``:

1. input: stage 0 embeds its batch; stage ``s > 0`` takes stage ``s - 1``'s activations (synchronous: those of the
   same step, waiting for them; asynchronous: the newest already received, from a bounded
   :class:`~lightning_hetero.layerwise.replay.ReplayBuffer`, so a stage never waits for a slower predecessor while
   it has activations less than ``replay_capacity`` steps old);
2. its block, then the detached output goes to stage ``s + 1`` at once (non-blocking send);
3. its local head (an auxiliary head; the model's own head on the last stage) and the loss against the batch's
   labels, read from this stage's own copy of the batch; backward stays inside the stage;
4. with data parallelism, the stage's gradients are averaged over its replicas (label ``intra``).

The optimizer step is the caller's (each stage has its own optimizer over its own parameters). Nothing crosses a
stage boundary backwards, so there is no pipeline bubble and a step's link time is one activation tensor per
boundary. In synchronous mode the result equals training every block on the detached output of the block before it,
step by step, in one process (tests/dist/test_layerwise_strategy.py checks it bit for bit).

:meth:`DecoupledRuntime.export` writes the whole trained model (every stage's share gathered to global rank 0) in the
format of ``GreedyLayerwise``'s export: HF ``save_pretrained``, or ``model.pt`` for a CNN.

Ledger labels: activations, headers and the evaluation loss broadcast use ``pipeline``; the replicas' gradient
average uses ``intra``; the export's transfer uses
:data:`lightning_hetero.pipeline.stage_gather.EXPORT_LABEL`. Nothing here imports Lightning.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hetero import comm
from lightning_hetero.core import StrategyRuntime, average_gradients, broadcast_module_state
from lightning_hetero.layerwise.decoupled import ActivationLink, batch_signature
from lightning_hetero.layerwise.dgl_stage import DGLStageModel, build_dgl_stage, check_head_output
from lightning_hetero.layerwise.loss_report import ModelLossReport
from lightning_hetero.layerwise.replay import BatchRing, ReplayBuffer
from lightning_hetero.layerwise.settings import LayerwiseSettings
from lightning_hetero.pipeline.layout import PipelineGroups, PipelineLayout, PipelinePlacement
from lightning_hetero.pipeline.stage_holder import find_stage_holder

__all__ = ["CHECKPOINT_FORMAT", "MODES", "DecoupledRuntime"]

MODES = ("sync", "async")
CHECKPOINT_FORMAT = "lightning_hetero.layerwise_dgl/1"
META_FILE = "meta.json"
TRAIN_TAG, EVAL_TAG = 10, 20
_MUST_MATCH = ("num_stages", "signature", "aux_head", "family")


class DecoupledRuntime(PipelinePlacement, StrategyRuntime):
    """The loop-independent part of the ``layerwise`` (DGL) strategies, shared by the Trainer and Fabric adapters.

    Args:
        settings: The strategy's settings (see :class:`~lightning_hetero.layerwise.settings.LayerwiseSettings`;
            checked there). ``export_dir`` is the Trainer adapter's business.
        owner: Class name used in error messages.
    """

    checkpoint_key = "layerwise_dgl"
    directory_checkpoint = True
    restore_after_setup = True

    settings: LayerwiseSettings

    def __init__(self, settings: LayerwiseSettings, owner: str = "LayerwiseStrategy") -> None:
        self._attach_settings(settings, LayerwiseSettings, owner)
        self.layout = PipelineLayout(settings.pipeline.num_stages, settings.pipeline.data_parallel_size)
        self._expected: dict[tuple, tuple[int, ...]] = {}  # per-sample input shape of this stage, per batch signature
        self.groups: PipelineGroups | None = None
        self.stack: Any | None = None
        self.container: DGLStageModel | None = None
        self.buffer = ReplayBuffer(self.settings.replay_capacity)
        self.ring = BatchRing(self.settings.replay_capacity)
        self._links: dict[str, ActivationLink] = {}
        self.steps = 0
        """Training steps done by this stage (checkpointed)."""
        self.last_staleness = 0
        """``step - producing step`` of the activations the last training step used (0 in synchronous mode)."""
        self._head_checked = False
        self.loss_report = ModelLossReport(None, None, torch.device("cpu"))
        """The last stage's loss on global rank 0 (see :mod:`~lightning_hetero.layerwise.loss_report`)."""

    # ------------------------------------------------------------------------------------------------ topology
    @property
    def stage(self) -> DGLStageModel:
        """This rank's stage module (after :meth:`setup`)."""
        if self.container is None:
            raise self._not_set_up()
        return self.container

    def _link(self, direction: str, tag: int) -> ActivationLink:
        key = f"{direction}{tag}"
        if key not in self._links:
            groups = self._groups
            peer = groups.next_rank if direction == "out" else groups.prev_rank
            asynchronous = self.settings.mode == "async" and tag == TRAIN_TAG
            policy = self.settings.on_bad_payload if asynchronous else "raise"
            link = ActivationLink(
                peer,
                self.settings.pipeline.boundary_dtype,
                tag,
                asynchronous,
                self.settings.max_in_flight,
                on_bad_payload=policy,
            )
            if tag == TRAIN_TAG:  # one training message per step and boundary: count from the (resumed) step
                link.messages_sent = link.messages_received = self.steps
            self._links[key] = link
        return self._links[key]

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self, module: nn.Module, device: torch.device, global_rank: int) -> nn.Module:
        """Replace the model inside ``module`` by this rank's stage (idempotent; collective with replicas)."""
        if self.groups is None:
            self.groups = PipelineGroups(self.layout, global_rank)
            sender, receiver = self.layout.global_rank(self.num_stages - 1, 0), self.layout.global_rank(0, 0)
            role, peer = None, None
            if self.num_stages > 1 and global_rank in (sender, receiver):
                role, peer = ("send", receiver) if global_rank == sender else ("receive", sender)
            lag = (self.num_stages - 1) * (self.settings.max_in_flight + 1)  # how far stage 0 can run ahead anyway
            self.loss_report = ModelLossReport(role, peer, device, lag, window=lag + self.settings.replay_capacity + 1)
        existing = find_stage_holder(module, DGLStageModel)
        if existing is not None:
            self._check_holder(existing)
            self.container = existing
            return module
        self.stack, self.container = build_dgl_stage(
            module,
            self.num_stages,
            self.stage_index,
            self.settings.boundaries,
            self.settings.aux_head,
            self.settings.aux_outputs,
            device,
        )
        if self.data_parallel_size > 1 and self._groups.dp_group is not None:
            source = self.layout.global_rank(self.stage_index, 0)
            broadcast_module_state(self.container, source, group=self._groups.dp_group, label=comm.INTRA)
        return module

    @property
    def _stack(self) -> Any:
        if self.stack is None:
            raise self._not_set_up()
        return self.stack

    # ------------------------------------------------------------------------------------------------ steps
    def _features(self, x: Tensor | None, batch: Mapping[str, Any]) -> Tensor:
        stage, stack = self.stage, self._stack
        hidden = stack.embed(batch) if x is None else x
        return stage.block(hidden, stack.context_of(batch))

    def _local_loss(self, hidden: Tensor, batch: Mapping[str, Any]) -> Tensor:
        logits = self.stage.head(hidden)
        if not self._head_checked:
            check_head_output(logits, self._stack.num_outputs, self.stage_index, self.settings.aux_head)
            self._head_checked = True
        return self._stack.loss(logits, batch)

    def _dtype(self) -> torch.dtype:
        return next((p.dtype for p in self.stage.parameters() if p.is_floating_point()), torch.float32)

    def _device(self, batch: Mapping[str, Any]) -> torch.device:
        return next(v.device for v in batch.values() if isinstance(v, Tensor))

    def _expect(self, batch: Mapping[str, Any]) -> tuple[int, tuple[int, ...]]:
        """``(batch size, per-sample shape)`` of the activations this stage must receive for ``batch`` (local)."""
        signature = batch_signature(batch)
        if signature not in self._expected:
            self._expected[signature] = self._stack.block_input_shape(self.stage_index, batch)
        return next(v.shape[0] for v in batch.values() if isinstance(v, Tensor)), self._expected[signature]

    def _expect_step(self, step: int) -> tuple[int, tuple[int, ...]] | None:
        try:
            return self._expect(self.ring.get(step))
        except KeyError:  # a batch no longer kept: the message is only bounded (it is too stale to be used)
            return None

    def _input(self, batch: Mapping[str, Any]) -> tuple[Tensor | None, Mapping[str, Any], int]:
        """This step's input activations, the batch they belong to and the step that batch was read at."""
        step = self.steps
        if self.is_first:
            return None, batch, step
        device, dtype = self._device(batch), self._dtype()
        link = self._link("in", TRAIN_TAG)
        if self.settings.mode == "sync":
            size, sample = self._expect(batch)
            return link.receive(size, batch_signature(batch), device, dtype, sample), batch, step
        self.ring.add(step, batch)
        for produced, activations in link.poll(step + 1, device, dtype, expect=self._expect_step):
            self.buffer.push(produced, activations)
        entry = self.buffer.newest_usable(step)
        while entry is None:  # nothing fresh enough: wait for the next message (the one of this step at the latest)
            if link.messages_received > step:  # this step's message was dropped (on_bad_payload="drop")
                raise link.nothing_to_replay(step)
            for produced, activations in link.poll(step + 1, device, dtype, block=True, expect=self._expect_step):
                self.buffer.push(produced, activations)
            entry = self.buffer.newest_usable(step)
        return entry.activations, self.ring.get(entry.step), entry.step

    def train_step(self, batch: Mapping[str, Any]) -> Tensor:
        """One DGL step of this stage: input, block, send, local loss, backward (+ replica average).

        Gradients are added to ``.grad`` of this stage's parameters. Returns this stage's local loss (detached): the
        auxiliary loss, or the model's loss on the last stage. No collective over the pipeline.
        """
        batch = self._stack.as_batch(batch)
        x, used_batch, produced = self._input(batch)
        self.last_staleness = self.steps - produced
        hidden = self._features(x, used_batch)
        if not self.is_last:
            self._link("out", TRAIN_TAG).send(hidden, produced, batch_signature(used_batch))
        loss = self._local_loss(hidden, used_batch)
        loss.backward()
        self.sync_data_parallel_gradients()
        self.steps += 1
        if self.is_last:
            self.loss_report.send(loss.detach(), self.steps - 1)
        self.loss_report.poll(self.steps)
        return loss.detach()

    @property
    def model_loss(self) -> float | None:
        """The model's training loss as known here: the last stage's own; on global rank 0 the newest one the last
        stage has sent (it lags by the steps in flight); None elsewhere and before the first one arrives."""
        return self.loss_report.value

    def sync_data_parallel_gradients(self) -> None:
        """Average this stage's gradients over its replicas (one all-reduce per dtype)."""
        groups = self._groups
        if self.data_parallel_size > 1 and groups.dp_group is not None:
            average_gradients([p for p in self.stage.parameters() if p.requires_grad], groups.dp_group, comm.INTRA)

    def flush(self) -> None:
        """Finish the training messages in flight (before evaluation, checkpoints and the end of a fit).

        The sender waits for its sends; in asynchronous mode the receiver takes every message its predecessor has
        sent for the steps done so far (they go into the replay buffer).
        """
        out = self._links.get(f"out{TRAIN_TAG}")
        if out is not None:
            out.flush_sends()
        link = self._links.get(f"in{TRAIN_TAG}")
        if link is not None and self.settings.mode == "async" and self.container is not None:
            device = next((p.device for p in self.stage.parameters()), torch.device("cpu"))
            for produced, activations in link.drain_until(self.steps, device, self._dtype(), self._expect_step):
                self.buffer.push(produced, activations)
        self.loss_report.flush(self.steps)

    @torch.no_grad()
    def _eval_hidden(self, batch: Mapping[str, Any]) -> Tensor:
        """Forward-only through this stage (receiving from / sending to the neighbours on the evaluation tag)."""
        x = None
        if not self.is_first:
            size, sample = self._expect(batch)
            link = self._link("in", EVAL_TAG)
            x = link.receive(size, batch_signature(batch), self._device(batch), self._dtype(), sample)
        hidden = self._features(x, batch)
        if not self.is_last:
            link = self._link("out", EVAL_TAG)
            link.send(hidden, 0, batch_signature(batch))
            link.flush_sends()
        return hidden

    @torch.no_grad()
    def eval_step(self, batch: Mapping[str, Any]) -> Tensor:
        """Forward through the whole pipeline (no training); the model's loss on every rank (broadcast)."""
        batch = self._stack.as_batch(batch)
        hidden = self._eval_hidden(batch)
        value = torch.zeros(1, dtype=torch.float32, device=hidden.device)
        if self.is_last:
            value[0] = self._stack.loss(self.stage.head(hidden), batch).float()
        groups = self._groups
        if groups.pipeline_group is not None and self.num_stages > 1:
            comm.broadcast(value, groups.last_rank, label=comm.PIPELINE, group=groups.pipeline_group)
        return value[0]

    @torch.no_grad()
    def predict(self, batch: Mapping[str, Any]) -> Tensor | None:
        """Forward through the whole pipeline; the model's logits on the last stage, None on the others."""
        hidden = self._eval_hidden(self._stack.as_batch(batch))
        return self.stage.head(hidden) if self.is_last else None

    def export(self, path: str | Path) -> str | None:
        """Write the whole model to ``path`` as an ordinary model (collective: every rank calls it; rank 0 writes).

        Each stage's share (replica 0's) is gathered to global rank 0 as safetensors bytes (sizes bounded, values
        checked, nothing unpickled), joined and written with
        :func:`~lightning_hetero.layerwise.export.save_model`: HF models with ``save_pretrained``
        (``from_pretrained`` loads them; a tied embedding / LM head, trained as two copies by the first and last
        stage, is exported untied), others as ``model.pt``. Auxiliary heads are not part of it.

        Returns:
            ``path`` on global rank 0, None elsewhere.
        """
        from lightning_hetero.layerwise.export import (
            export_bytes_limit,
            merge_stage_states,
            save_model,
            stage_export_state,
        )
        from lightning_hetero.pipeline.stage_gather import gather_stage_states

        self.flush()
        root = self._stack.root
        device = next((p.device for p in self.stage.parameters()), torch.device("cpu"))
        state, limit = stage_export_state(root), export_bytes_limit(root)  # every stage's share fits the model's
        states = gather_stage_states(state, self.layout, self._groups.rank, device, max_bytes=limit)
        if states is None:
            return None
        save_model(root, merge_stage_states(states, root), path, untie=self.num_stages > 1)
        return str(path)

    def clip_grad_norm_(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip this stage's gradients by their own norm (stages train independently; replicas are averaged)."""
        return torch.nn.utils.clip_grad_norm_(
            list(parameters), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def teardown(self) -> None:
        self.flush()

    # ------------------------------------------------------------------------------------------------ checkpoints
    def meta(self) -> dict[str, Any]:
        """What a checkpoint records about the pipeline (checked on resume)."""
        stack = self.stack
        return {
            "num_stages": self.num_stages,
            "data_parallel_size": self.data_parallel_size,
            "signature": getattr(stack, "signature", None),
            "family": getattr(stack, "family", None),
            "aux_head": self.settings.aux_head,
            "mode": self.settings.mode,
            "activation_dtype": self.settings.pipeline.boundary_dtype,
        }

    def extra_checkpoint_state(self, device: torch.device) -> dict[str, Any]:
        self.flush()  # the buffer is not saved: a resumed asynchronous stage starts from fresh activations
        return {"steps": self.steps, **{f"replay_{k}": v for k, v in self.buffer.stats().items()}}

    def load_extra_checkpoint_state(self, entry: Mapping[str, Any] | None) -> None:
        entry = entry or {}
        self.steps = int(entry.get("steps", 0))
        for link in self._links.values():
            link.messages_sent = link.messages_received = self.steps if link.tag == TRAIN_TAG else 0
        self.buffer.clear()
        self.ring.clear()
        self.loss_report.reset(self.steps)

    def checkpoint_part(self, global_rank: int) -> str | None:
        return f"stage_{self.stage_index}" if self.layout.dp_rank_of(global_rank) == 0 else None

    def checkpoint_part_to_load(self, global_rank: int) -> str:
        return f"stage_{self.layout.stage_of(global_rank)}"

    def write_checkpoint_meta(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"format": CHECKPOINT_FORMAT, **self.meta()}, indent=2, sort_keys=True)
        (directory / META_FILE).write_text(text)

    def check_checkpoint_meta(self, directory: Path) -> None:
        path = Path(directory) / META_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{self.owner}: {directory} is not a layerwise (DGL) checkpoint folder (no {META_FILE}); it holds "
                "one stage_<s>.pt per stage plus meta.json."
            )
        saved = json.loads(path.read_text())
        current = self.meta()
        for key in _MUST_MATCH:
            if current.get(key) is not None and saved.get(key) != current[key]:
                raise ValueError(
                    f"{self.owner}: the checkpoint at {directory} was saved with {key}={saved.get(key)!r}, this run "
                    f"has {key}={current[key]!r}. Resume with the same split (num_stages / boundaries) and aux_head."
                )
