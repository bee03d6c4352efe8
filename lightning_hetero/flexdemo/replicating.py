"""The base of the replicating optimizers: local state update, replicated exchange, apply.

:class:`ReplicatingOptimizer` owns the protocol shared by every FlexDeMo optimizer:

1. ``bind(group)`` names the replicate (inter-node) process group; unbound means a single replica (nothing is sent,
   the update is computed as with ``n = 1``; a warning is issued once if ``torch.distributed`` runs with more than
   one rank, because each rank then trains on its own).
2. ``launch(params)`` (optional, for overlap with backward): for parameters whose gradients are final, update the
   local state, encode, and start the async inter-node collective for that bucket. Every replica must launch the
   same parameters in the same order (collectives are matched by order).
3. ``step()`` launches everything not launched yet as one bucket, waits for every bucket in launch order, decodes
   (identically on every replica) and checks every combined update (finite, at most ``MAX_PEER_MAGNITUDE``; see
   :mod:`lightning_hetero.comm.validation`), and only then applies them, so a refused peer payload leaves every
   parameter and all optimizer state untouched; then it lets the replicator finish the step (DiLoCo's outer sync).
   Results do not depend on how parameters were bucketed.

Parameters may be FSDP2 ``DTensor`` shards: the optimizer works on ``to_local()`` views; empty local shards cost no
bytes and are updated trivially. All optimizer state is float32 (also under bf16 parameters) and lives in
``optimizer.state[p]``; the replicator's state (step counter, which drives every pseudo-random selection, and DiLoCo's
anchors/outer momentum) is saved under the extra top-level key ``"replicator"`` of :meth:`state_dict`.

The concrete optimizers (:class:`~lightning_hetero.flexdemo.optim.DeMoSGD`,
:class:`~lightning_hetero.flexdemo.optim.DecoupledAdamW`) and their update semantics live in
:mod:`lightning_hetero.flexdemo.optim`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_hetero.comm.validation import PeerPayloadError, report_dropped
from lightning_hetero.replication import Bucket, Replicator, build_replicator
from lightning_hetero.replication.base import check_combined

try:  # DTensor moved to a public module in torch 2.4; keep plain tensors working without it
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["ReplicatingOptimizer", "local_tensor"]

_REPLICATOR_KEY = "replicator"


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``tensor`` as a plain tensor sharing its storage (``tensor`` itself if not a DTensor)."""
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


@dataclass
class _Entry:
    """One parameter of the optimizer: its launch-order key, the tensor and its param group."""

    key: int
    param: torch.Tensor
    group: dict[str, Any]


class ReplicatingOptimizer(torch.optim.Optimizer):
    """Base class: local state update, replicated exchange, apply. Subclasses define ``_source`` and ``_apply``.

    Args:
        params: Parameters or parameter groups (plain tensors or FSDP2 DTensors).
        defaults: Per-group hyperparameters.
        replicator: A :class:`Replicator`, a name for :func:`build_replicator`, or None for the class default.
        kept_fraction: Passed to :func:`build_replicator` when ``replicator`` is a name or None.
        replicator_options: Passed to :func:`build_replicator` likewise.
    """

    default_replicator: ClassVar[str] = "demo"

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        replicator: Replicator | str | None,
        kept_fraction: float,
        replicator_options: dict[str, Any],
    ) -> None:
        super().__init__(params, defaults)
        self.replicator = self._resolve_replicator(replicator, kept_fraction, replicator_options)
        self.replicator.attach(self)
        self._bound = False
        self._step_open = False
        self._buckets: list[tuple[list[_Entry], Bucket]] = []
        self._launched: set[int] = set()
        self._launched_early = 0
        self._warned_unbound = False
        self._last_stats: dict[str, Any] = {}

    # ---------------------------------------------------------------------------------------------- set up
    def _resolve_replicator(
        self, replicator: Replicator | str | None, kept_fraction: float, options: dict[str, Any]
    ) -> Replicator:
        if isinstance(replicator, Replicator):
            if options:
                raise ValueError(
                    f"replicator options {sorted(options)} were given with a ready-built {type(replicator).__name__};"
                    " pass them to its constructor (or pass the replicator by name)."
                )
            return replicator
        if replicator is None or isinstance(replicator, str):
            return build_replicator(replicator or self.default_replicator, kept_fraction, **options)
        raise TypeError(f"replicator must be a Replicator, a name or None, got {type(replicator).__name__}.")

    def bind(self, group: Any | None, replicator: Replicator | None = None) -> None:
        """Use ``group`` as the replicate group (None: a single replica); optionally swap in ``replicator`` first.

        Raises:
            RuntimeError: A replicator swap after the first step (its state would not match the optimizer's).
        """
        if replicator is not None and replicator is not self.replicator:
            if self.replicator.step or any(self.state.values()):
                raise RuntimeError("bind(replicator=...) must happen before the first optimizer step.")
            replicator.attach(self)
            self.replicator = replicator
        self.replicator.setup(group)
        self._bound = True

    @property
    def num_replicas(self) -> int:
        """Replicas the update is combined over (1 when unbound)."""
        return self.replicator.num_replicas

    def _entries(self) -> list[_Entry]:
        entries, key = [], 0
        for group in self.param_groups:
            for param in group["params"]:
                entries.append(_Entry(key, param, group))
                key += 1
        return entries

    def _open_step(self) -> None:
        if self._step_open:
            return
        if (
            not self._bound
            and not self._warned_unbound
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            warnings.warn(
                f"{type(self).__name__}.step() before bind(): running as a single replica (no inter-node exchange)."
                " Call optimizer.bind(replicate_group) (the FlexDeMo strategy does) or bind(None) to silence this.",
                stacklevel=3,
            )
            self._warned_unbound = True
        self.replicator.start_step([(e.key, local_tensor(e.param)) for e in self._entries()])
        self._step_open = True

    # -------------------------------------------------------------------------------------------- protocol
    def launch(self, params: Iterable[torch.Tensor]) -> None:
        """Encode ``params`` (gradients final) and start their inter-node collective now, as one bucket.

        Raises:
            ValueError: A parameter this optimizer does not hold.
            RuntimeError: A parameter launched twice in one step.
        """
        wanted = list(params)
        if not wanted:
            return
        by_id = {id(e.param): e for e in self._entries()}
        entries = []
        for param in wanted:
            entry = by_id.get(id(param))
            if entry is None:
                raise ValueError("launch() got a parameter that is not in this optimizer's param_groups.")
            if entry.key in self._launched:
                raise RuntimeError(f"Parameter #{entry.key} was already launched in this step.")
            entries.append(entry)
        with torch.no_grad():
            self._open_step()
            self._launch(entries, early=True)

    def _launch(self, entries: list[_Entry], *, early: bool) -> None:
        pieces = []
        for entry in entries:
            state = self.state[entry.param]
            local = local_tensor(entry.param)
            grad = entry.param.grad
            if grad is None:  # every replica must join each collective: a missing gradient counts as zero
                grad_local = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
            else:
                grad_local = local_tensor(grad).float()
            pieces.append(self.replicator.encode(entry.key, self._source(state, grad_local, entry.group)))
            self._launched.add(entry.key)
        if early:
            self._launched_early += len(entries)
        self._buckets.append((entries, self.replicator.launch(pieces, early=early)))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Launch what was not launched, wait, decode and apply; return the closure's loss if one was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._open_step()
        entries = self._entries()
        pending = [e for e in entries if e.key not in self._launched]
        if pending:
            self._launch(pending, early=False)
        # Decode and check every bucket before touching any parameter or optimizer state: a refused payload in a
        # later bucket must not leave the earlier ones applied (on_bad_payload="raise": the weights stay as they were).
        try:
            decoded = [
                (entry, self._checked(entry, combined))
                for bucket_entries, bucket in self._buckets
                for entry, combined in zip(bucket_entries, self.replicator.finish(bucket), strict=True)
            ]
        except PeerPayloadError:
            self._buckets, self._launched, self._launched_early, self._step_open = [], set(), 0, False
            raise
        for entry, combined in decoded:
            self._apply(self.state[entry.param], local_tensor(entry.param), combined, entry.group)
        self.replicator.end_step([(e.key, local_tensor(e.param)) for e in entries])
        self._last_stats = {
            **self.replicator.stats,
            "launched_early": self._launched_early,
            "step": self.replicator.step,
        }
        self._buckets, self._launched, self._launched_early, self._step_open = [], set(), 0, False
        return loss

    def _checked(self, entry: _Entry, combined: torch.Tensor) -> torch.Tensor:
        """``combined`` if finite and within ``MAX_PEER_MAGNITUDE``; else raise, or (``on_bad_payload="drop"``) zeros.

        The replicators already refuse such combinations; this keeps the guarantee for any :class:`Replicator`
        subclass, right where the update meets the parameters.
        """
        try:
            check_combined(combined, entry.key, f"the combined values from {type(self.replicator).__name__}")
        except PeerPayloadError as error:
            if self.replicator.on_bad_payload != "drop":
                raise
            report_dropped(error, f"piece {entry.key}: no update this step", self.replicator)
            return torch.zeros_like(combined)
        return combined

    def comm_stats(self) -> dict[str, Any]:
        """Of the last completed step: ``launched_early`` (parameters launched before ``step()``), ``buckets``,
        ``wait_seconds`` (blocked in wait), ``comm_seconds`` (wall-clock time with a bucket in flight: the union
        of the buckets' launch-to-completion spans, at most the step; completion is observed when waited for),
        ``encode_seconds``, ``decode_seconds``, ``payload_bytes`` (this rank's inter-node payload) and ``step``
        (steps completed)."""
        return dict(self._last_stats)

    # ----------------------------------------------------------------------------------------- subclass API
    def _source(self, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The float32 tensor handed to the replicator (mutated in place by error feedback)."""
        raise NotImplementedError

    def _apply(self, state: dict[str, Any], param: torch.Tensor, combined: torch.Tensor, group: dict[str, Any]) -> None:
        """Update the local parameter shard ``param`` in place from the combined tensor."""
        raise NotImplementedError

    @staticmethod
    def _buffer(state: dict[str, Any], name: str, like: torch.Tensor) -> torch.Tensor:
        if name not in state:
            state[name] = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        return state[name]

    @staticmethod
    def _descend(param: torch.Tensor, direction: torch.Tensor, group: dict[str, Any]) -> None:
        """Decoupled weight decay, then ``param -= lr * (sign(direction) if sign else direction)``."""
        lr, weight_decay = group["lr"], group["weight_decay"]
        if weight_decay:
            param.mul_(1 - lr * weight_decay)
        update = torch.sign(direction) if group["sign"] else direction
        param.add_(update.to(param.dtype), alpha=-lr)

    # ------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus the replicator's state under ``"replicator"``."""
        state_dict = super().state_dict()
        state_dict[_REPLICATOR_KEY] = self.replicator.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly: state tensors keep their saved dtype (float32 under bf16 params).

        Raises:
            ValueError: The parameter groups do not match this optimizer's.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(group["params"])
            for saved, group in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError("The checkpoint's parameter groups do not match this optimizer's (count or sizes).")
        by_index = {
            index: param
            for saved, group in zip(saved_groups, self.param_groups, strict=True)
            for index, param in zip(saved["params"], group["params"], strict=True)
        }
        self.state.clear()
        for index, saved_state in state_dict["state"].items():
            param = by_index[index]
            device = local_tensor(param).device
            restored = {}
            for name, value in saved_state.items():
                if isinstance(value, torch.Tensor):
                    restored[name] = value.detach().clone() if name == "step" else value.detach().to(device).clone()
                else:
                    restored[name] = copy.deepcopy(value)
            self.state[param] = restored
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})
        if _REPLICATOR_KEY in state_dict:
            self.replicator.load_state_dict(state_dict[_REPLICATOR_KEY])
