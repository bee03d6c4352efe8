"""The subspace pipeline's schedule executor over counted point-to-point messages, and its batch helpers.

The rank layout and process groups (:class:`~lightning_hetero.pipeline.layout.PipelineLayout`,
:class:`~lightning_hetero.pipeline.layout.PipelineGroups`) live in :mod:`lightning_hetero.pipeline.layout`.
:class:`PipelineExecutor` runs a :mod:`~lightning_hetero.subspace_pipeline.schedules` action list. Every boundary
message goes through :mod:`lightning_hetero.comm` with the label :data:`~lightning_hetero.comm.PIPELINE` and is exactly
the tensor the stage produced (forward) or the gradient autograd computed for it (backward): ``mb * S * k`` elements of
the coordinate dtype each way per boundary and microbatch. Token ids never travel: every stage of a replica reads the
same batch from its own data loader.

Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hetero import comm
from lightning_hetero.comm.validation import check_values
from lightning_hetero.pipeline.layout import PipelineGroups
from lightning_hetero.subspace_pipeline.schedules import build_schedule

__all__ = [
    "BACKWARD_TAG",
    "FORWARD_TAG",
    "IGNORE_INDEX",
    "PipelineExecutor",
    "StageLike",
    "shifted_ce_sum",
    "split_batch",
    "valid_tokens",
]

FORWARD_TAG = 0
"""Message tag of boundary coordinates (stage ``s`` to ``s + 1``)."""
BACKWARD_TAG = 1
"""Message tag of boundary gradients (stage ``s + 1`` to ``s``)."""


IGNORE_INDEX = -100
"""Label value skipped by the default loss (padding)."""


def split_batch(batch: Any, n_microbatches: int, owner: str = "SubspacePipelineStrategy") -> list[dict[str, Tensor]]:
    """Split a batch into ``n_microbatches`` dicts along dim 0; ``labels`` default to ``input_ids``.

    Accepts a dict with ``input_ids`` (and optionally ``labels``, other per-sample tensors), a tensor of ids, or a
    ``(input_ids, labels)`` pair.

    Raises:
        TypeError: An unsupported batch type.
        ValueError: The batch size is not a multiple of ``n_microbatches``.
    """
    if isinstance(batch, Tensor):
        batch = {"input_ids": batch}
    elif isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
        batch = {"input_ids": batch[0], "labels": batch[1]}
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), Tensor):
        raise TypeError(
            f"{owner} needs batches that are a dict with 'input_ids' (and optionally 'labels'), a tensor of token "
            f"ids, or an (input_ids, labels) pair; got {type(batch).__name__}."
        )
    ids = batch["input_ids"]
    size = ids.shape[0]
    if size % n_microbatches:
        raise ValueError(
            f"{owner}(n_microbatches={n_microbatches}): the batch has {size} sequences, which does not split into "
            f"{n_microbatches} equal microbatches. Use a batch size that is a multiple of n_microbatches."
        )
    full = dict(batch)
    full.setdefault("labels", ids)
    chunks: list[dict[str, Tensor]] = [{} for _ in range(n_microbatches)]
    for key, value in full.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == size:
            for chunk, part in zip(chunks, value.tensor_split(n_microbatches), strict=True):
                chunk[key] = part
    return chunks


def shifted_ce_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of next-token cross-entropies (position t predicts label t+1), skipping IGNORE_INDEX labels."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def valid_tokens(chunks: Sequence[Mapping[str, Tensor]]) -> int:
    """Label positions that count in the shifted loss over all microbatches (at least 1)."""
    return max(1, sum(int((chunk["labels"][:, 1:] != IGNORE_INDEX).sum()) for chunk in chunks))


class StageLike(Protocol):
    """What the executor needs from a stage module (:class:`lightning_hetero.subspace_pipeline.stages.StageModule`)."""

    is_first: bool
    is_last: bool

    def __call__(self, x: Tensor | None, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor: ...

    def boundary_shape(self, batch: int, seq: int) -> tuple[int, ...]: ...


class PipelineExecutor:
    """Runs one stage's side of a GPipe or 1F1B step (or a forward-only pass) over counted p2p messages.

    Args:
        stage: This rank's stage module: ``stage(x, input_ids)``, ``is_first``, ``is_last``,
            ``boundary_shape(batch, seq)`` and ``boundary_dtype``.
        groups: This rank's neighbours.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        label: Ledger label of the boundary messages.
    """

    def __init__(self, stage: nn.Module, groups: PipelineGroups, schedule: str, label: str = comm.PIPELINE) -> None:
        self.stage = stage
        self.groups = groups
        self.schedule = schedule
        self.label = label
        self.num_stages = groups.layout.num_stages

    def _boundary(self, input_ids: Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        batch, seq = input_ids.shape[:2]
        shape = tuple(self.stage.boundary_shape(batch, seq))
        dtype = getattr(self.stage, "boundary_dtype", torch.float32)
        return shape, dtype

    def _receive(self, src: int, input_ids: Tensor, tag: int, requires_grad: bool) -> Tensor:
        shape, dtype = self._boundary(input_ids)
        buffer = torch.empty(shape, dtype=dtype, device=input_ids.device)
        comm.recv(buffer, src, label=self.label, tag=tag)
        self._check_received(buffer, src, tag)
        return buffer.requires_grad_(requires_grad and buffer.is_floating_point())

    def _check_received(self, buffer: Tensor, src: int, tag: int) -> None:
        """Refuse NaN/Inf activations or gradients from a neighbour (the stage's codec knows what may be raw bits)."""
        what = "boundary activations" if tag == FORWARD_TAG else "boundary gradients"
        codec = getattr(self.stage, "codec", None)
        if codec is not None and hasattr(codec, "check_wire"):
            # Both directions are decoded into the stage's compute dtype: a float16 stage refuses what it cannot hold.
            codec.check_wire(buffer, peer=src, what=what, dtype=getattr(self.stage, "compute_dtype", None))
        else:
            check_values(buffer, peer=src, what=what)

    def _send(self, tensor: Tensor, dst: int, input_ids: Tensor, tag: int, pending: list[Any]) -> None:
        shape, dtype = self._boundary(input_ids)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(
                f"stage {self.groups.stage} produced a boundary tensor of shape {tuple(tensor.shape)} and dtype "
                f"{tensor.dtype}; its boundary_shape/boundary_dtype promise {shape} / {dtype}."
            )
        payload = tensor.detach().contiguous()
        pending.append((comm.isend(payload, dst, label=self.label, tag=tag), payload))  # keep payload alive

    def _run_stage(self, x: Tensor | None, microbatch: Mapping[str, Tensor]) -> Tensor:
        mask = microbatch.get("attention_mask")
        if mask is None:
            return self.stage(x, microbatch["input_ids"])
        return self.stage(x, microbatch["input_ids"], mask)

    def train(
        self, microbatches: Sequence[Mapping[str, Tensor]], loss_fn: Callable[[Tensor, int], Tensor] | None
    ) -> list[Tensor]:
        """Forward and backward of every microbatch; gradients accumulate into the stage's ``.grad``.

        Args:
            microbatches: Per microbatch a dict with ``input_ids`` ``(mb, S)`` (every stage reads them from its data
                loader) and optionally ``attention_mask`` (right padding), passed to the stage.
            loss_fn: On the last stage, ``loss_fn(logits, microbatch_index)`` returns the scalar whose gradient is
                wanted (already weighted for the sum over microbatches). Ignored on other stages.

        Returns:
            The last stage's per-microbatch losses (detached); an empty list on other stages.
        """
        stage, groups = self.stage, self.groups
        if stage.is_last and loss_fn is None:
            raise ValueError("The last stage needs a loss_fn to train.")
        actions = build_schedule(self.schedule, groups.stage, self.num_stages, len(microbatches))
        pending: list[Any] = []
        inputs: dict[int, Tensor | None] = {}
        outputs: dict[int, Tensor] = {}
        losses: list[Tensor] = []
        for action in actions:
            m = action.microbatch
            ids = microbatches[m]["input_ids"]
            if action.kind == "F":
                x = None if stage.is_first else self._receive(groups.prev_rank, ids, FORWARD_TAG, True)
                out = self._run_stage(x, microbatches[m])
                if stage.is_last:
                    out = loss_fn(out, m)
                    losses.append(out.detach())
                else:
                    self._send(out, groups.next_rank, ids, FORWARD_TAG, pending)
                inputs[m], outputs[m] = x, out
            else:
                x, out = inputs.pop(m), outputs.pop(m)
                if stage.is_last:
                    out.backward()
                else:
                    grad = self._receive(groups.next_rank, ids, BACKWARD_TAG, False)
                    if out.requires_grad:
                        torch.autograd.backward(out, grad)
                if x is not None:
                    grad_in = x.grad if x.grad is not None else torch.zeros_like(x)
                    self._send(grad_in, groups.prev_rank, ids, BACKWARD_TAG, pending)
        for work, _ in pending:
            work.wait()
        return losses

    @torch.no_grad()
    def forward_only(
        self, microbatches: Sequence[Mapping[str, Tensor]], output_fn: Callable[[Tensor, int], Tensor]
    ) -> list[Tensor]:
        """Forward every microbatch (no autograd); the last stage returns ``output_fn(logits, m)`` for each."""
        stage, groups = self.stage, self.groups
        pending: list[Any] = []
        results: list[Tensor] = []
        for m, microbatch in enumerate(microbatches):
            ids = microbatch["input_ids"]
            x = None if stage.is_first else self._receive(groups.prev_rank, ids, FORWARD_TAG, False)
            out = self._run_stage(x, microbatch)
            if stage.is_last:
                results.append(output_fn(out, m))
            else:
                self._send(out, groups.next_rank, ids, FORWARD_TAG, pending)
        for work, _ in pending:
            work.wait()
        return results
