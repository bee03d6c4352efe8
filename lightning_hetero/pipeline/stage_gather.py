"""Bring every pipeline stage's state to rank 0 (for a dense export), bounded and decoded without unpickling.

:func:`gather_stage_states` collects replica 0's stage state dicts on global rank 0: each announced size is bounded
before anything is allocated, and the bytes are decoded by :func:`decode_stage_state` (safetensors only, finite and
bounded weights, or a :class:`~lightning_hetero.comm.validation.PeerPayloadError` naming the stage's rank).
:func:`stage_bytes_limit` is the bound for a model config. Shared by the subspace pipeline and decoupled layerwise
training. Nothing here imports Lightning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor

from lightning_hetero import comm
from lightning_hetero.comm.validation import check_announced_size, check_values, peer_decoding
from lightning_hetero.pipeline.layout import PipelineLayout

__all__ = ["EXPORT_LABEL", "decode_stage_state", "gather_stage_states", "stage_bytes_limit"]

EXPORT_LABEL = "export"
"""Ledger label of :func:`gather_stage_states` (stage states sent to rank 0 for export)."""

_MIN_STAGE_BYTES = 8  # a safetensors file starts with its 8-byte header length
_HEADER_BYTES_PER_TENSOR = 1024  # generous: one safetensors header entry is a name, a dtype, a shape and two offsets


def stage_bytes_limit(hf_config: Any) -> int:
    """The most bytes one stage's serialized state can take for the model of ``hf_config`` (a bound, not a size).

    A stage holds part of the model's parameters (fewer elements as subspace coordinates, as many when projected),
    plus the basis ``U`` and its accumulated statistic (each at most ``d x d``) and the four numbers of ``T_fixed``.
    Every element is counted at 8 bytes (float64 coordinates are allowed), plus room for the safetensors header.
    Pass it as ``max_bytes`` to :func:`gather_stage_states`.
    """
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    tensors = list(model.state_dict().values())
    hidden = int(getattr(hf_config, "hidden_size", 0) or 0)
    elements = sum(t.numel() for t in tensors) + 2 * hidden * hidden + 4
    return 8 * elements + _HEADER_BYTES_PER_TENSOR * (len(tensors) + 8) + (1 << 20)


def _memory_bytes() -> int:
    """This machine's physical memory: every gathered stage state must fit in it on rank 0 (a bound without config)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # not POSIX: a fixed ceiling instead
        return 1 << 40


def decode_stage_state(payload: bytes | Tensor, *, peer: int | None = None) -> dict[str, Tensor]:
    """The state dict a stage sent for export: safetensors bytes -> tensors, every floating value finite and bounded.

    Raises:
        PeerPayloadError: The bytes are not a safetensors file (field ``"export.payload"``), or a weight is NaN, Inf
            or above ``MAX_PEER_MAGNITUDE`` (field ``"export.<key>"``); names ``peer``.
    """
    with peer_decoding(peer, "export.payload"):
        raw = payload if isinstance(payload, bytes) else payload.detach().cpu().contiguous().numpy().tobytes()
        state = load_safetensors(raw)
    for key, value in state.items():
        check_values(value, peer=peer, what=f"export.{key}")
    return state


def gather_stage_states(
    state: Mapping[str, Tensor],
    layout: PipelineLayout,
    rank: int,
    device: torch.device,
    *,
    max_bytes: int | None = None,
) -> list[dict[str, Tensor]] | None:
    """Collect replica 0's stage state dicts on global rank 0, in stage order; None on every other rank.

    Collective: every rank calls it (other replicas return at once). Each stage serializes its state and sends its
    size, then the bytes, to rank 0 (counted with label :data:`EXPORT_LABEL`). Rank 0 refuses a size outside
    ``[8, max_bytes]`` before allocating anything, and decodes the bytes with :func:`decode_stage_state`.

    Args:
        state: This rank's stage ``state_dict`` (CPU tensors).
        layout: The rank layout.
        rank: This process's global rank.
        device: Device of the transport tensors (the stage's; NCCL needs CUDA tensors).
        max_bytes: The most bytes one stage may announce, e.g. :func:`stage_bytes_limit` of the model's config.
            Default: what is left of this machine's physical memory after the stages received so far (the gathered
            states must all fit there).

    Raises:
        PeerPayloadError: A stage announced a size outside the bound, or sent bytes that are not a safetensors state
            with finite, bounded weights; names the stage's rank and the field.
    """
    if layout.world_size == 1:
        return [dict(state)]
    if layout.dp_rank_of(rank) != 0:
        return None
    if rank != 0:
        # safetensors bytes: tensors only, nothing a receiver would unpickle.
        encoded = save_safetensors({k: v.detach().cpu().contiguous() for k, v in state.items()})
        payload = torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(device)
        comm.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), 0, label=EXPORT_LABEL)
        comm.send(payload, 0, label=EXPORT_LABEL)
        return None
    states = [dict(state)]
    held = sum(value.numel() * value.element_size() for value in state.values())
    for stage in range(1, layout.num_stages):
        src = layout.global_rank(stage, 0)
        size = torch.zeros(1, dtype=torch.int64, device=device)
        comm.recv(size, src, label=EXPORT_LABEL)
        limit = max_bytes if max_bytes is not None else max(_memory_bytes() - held, _MIN_STAGE_BYTES)
        announced = check_announced_size(size.cpu(), limit, peer=src, what="export.size", minimum=_MIN_STAGE_BYTES)
        with peer_decoding(src, "export.payload"):  # an allocation within the bound can still fail
            payload = torch.empty(announced, dtype=torch.uint8, device=device)
        comm.recv(payload, src, label=EXPORT_LABEL)
        states.append(decode_stage_state(payload, peer=src))
        held += announced
    return states
