"""Collective helpers every strategy runtime uses: initial-state broadcast, setup agreement, norm clipping.

All traffic goes through :mod:`lightning_hetero.comm`, so it is counted in the byte ledger under the given label.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hetero import comm
from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError

__all__ = [
    "MAX_JSON_BYTES",
    "all_gather_json",
    "decode_json_payload",
    "average_gradients",
    "broadcast_module_state",
    "clip_grad_norm_over_group",
]


@torch.no_grad()
def broadcast_module_state(module: nn.Module, source: int, group: Any = None, label: str = comm.INTER) -> int:
    """Copy ``source``'s parameters and buffers (local shards of DTensors) to every rank of ``group``.

    Tensors shared by several names go once; empty tensors are skipped. Returns the number of tensors broadcast.
    """
    count = 0
    seen: set[int] = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor.data
        if local.numel() == 0:
            continue
        if local.is_contiguous():
            comm.broadcast(local, source, group=group, label=label)
        else:
            staged = local.contiguous()
            comm.broadcast(staged, source, group=group, label=label)
            local.copy_(staged)
        count += 1
    return count


@torch.no_grad()
def average_gradients(parameters: Iterable[nn.Parameter], group: Any, label: str) -> None:
    """Average the gradients of ``parameters`` over ``group``: one flat all-reduce per dtype.

    A parameter without a gradient counts as zeros (it gets a zero gradient), so every rank sends the same tensors.
    """
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in parameters:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        by_dtype.setdefault(param.grad.dtype, []).append(param)
    for params in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        comm.all_reduce(flat, "avg", label=label, group=group)
        offset = 0
        for param in params:
            count = param.grad.numel()
            param.grad.copy_(flat[offset : offset + count].view_as(param.grad))
            offset += count


MAX_JSON_BYTES = 1 << 20
"""Default bound on one rank's JSON document in :func:`all_gather_json` (setup agreement needs a few KiB)."""

JsonSchema = Mapping[str, type | tuple[type, ...]]
"""Expected top-level keys of a JSON document and the Python types each value may have."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _bounded_float(text: str) -> float:
    # float("1e999") is inf: the peer rule allows finite values of magnitude <= MAX_PEER_MAGNITUDE only
    value = float(text)
    if not math.isfinite(value) or abs(value) > MAX_PEER_MAGNITUDE:
        raise ValueError(f"number {text[:40]} is not finite or above the bound 2**64")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 20 or abs(value := int(text)) > MAX_PEER_MAGNITUDE:  # 2**64 has 20 digits
        raise ValueError(f"integer {text[:40]}{'...' if len(text) > 40 else ''} is above the bound 2**64")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of duplicate keys: ranks reading the same bytes differently must not be possible
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicates = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"duplicate keys {[k[:40] for k in duplicates[:4]]}")
    return dict(pairs)


def decode_json_payload(raw: bytes, rank: int, schema: JsonSchema | None = None) -> Any:
    """Parse rank ``rank``'s UTF-8 JSON bytes and check them against ``schema`` (never pickle, never eval).

    Args:
        raw: The bytes as received.
        rank: The sender, named in the error.
        schema: When given, the document must be an object with exactly these keys, each value of the given
            type(s) (``type(None)`` allows null).

    Raises:
        PeerPayloadError: Not UTF-8, not JSON (NaN/Infinity constants included), a number that is not finite or of
            magnitude above ``MAX_PEER_MAGNITUDE`` (``1e999`` parses to inf), a key given twice, or not of the schema.
    """
    try:
        value = json.loads(
            raw.decode("utf-8"),
            parse_constant=_refuse_constant,
            parse_float=_bounded_float,
            parse_int=_bounded_int,
            object_pairs_hook=_unique_keys,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise PeerPayloadError(
            f"rank {rank} sent a setup document that is not JSON within the peer-payload rule: {error}",
            rank,
            "document",
        ) from None
    if schema is None:
        return value
    if not isinstance(value, dict) or set(value) != set(schema):
        keys = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise PeerPayloadError(
            f"rank {rank} sent a setup document with keys {keys}, expected {sorted(schema)} (a different version"
            " or configuration of lightning-hetero on that rank?).",
            rank,
            "document",
        )
    for key, expected in schema.items():
        item = value[key]
        numeric = expected in (int, float)  # bool is an int subclass, never what a numeric field means
        if not isinstance(item, expected) or (numeric and isinstance(item, bool)):
            raise PeerPayloadError(
                f"rank {rank} sent {key}={repr(item)[:80]} of type {type(item).__name__} in its setup document,"
                f" expected {expected}.",
                rank,
                key,
            )
    return value


def _check_lengths(lengths: list[int], max_bytes: int) -> None:
    for rank, announced in enumerate(lengths):
        if not 0 <= announced <= max_bytes:
            raise PeerPayloadError(
                f"rank {rank} announced a {announced}-byte setup document; the bound is {max_bytes} bytes.", rank
            )


def all_gather_json(
    payload: Any,
    world_size: int,
    device: torch.device,
    label: str = comm.INTER,
    *,
    max_bytes: int = MAX_JSON_BYTES,
    schema: JsonSchema | None = None,
) -> list[Any]:
    """Every rank's JSON-serializable ``payload`` (lengths first, then padded UTF-8 bytes; no pickle).

    Every rank checks every announced length against ``max_bytes`` before allocating (the same lengths everywhere,
    so every rank raises together) and parses each document with :func:`decode_json_payload` against ``schema``.

    Raises:
        PeerPayloadError: A length outside ``[0, max_bytes]`` or a document that is not JSON of the schema.
    """
    data = torch.tensor(list(json.dumps(payload, sort_keys=True, default=str).encode()), dtype=torch.uint8)
    if world_size == 1:
        _check_lengths([data.numel()], max_bytes)
        return [decode_json_payload(bytes(data.tolist()), 0, schema)]
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = torch.empty(world_size, dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(lengths, length, label=label)
    _check_lengths(lengths.tolist(), max_bytes)
    size = int(lengths.max())
    padded = torch.zeros(size, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    everything = torch.empty(world_size * size, dtype=torch.uint8, device=device)
    comm.all_gather_into_tensor(everything, padded, label=label)
    rows = everything.view(world_size, size).cpu()
    return [decode_json_payload(bytes(rows[r, : int(lengths[r])].tolist()), r, schema) for r in range(world_size)]


@torch.no_grad()
def clip_grad_norm_over_group(
    grads: Iterable[Tensor],
    max_norm: float,
    norm_type: float,
    group: Any,
    label: str,
    error_if_nonfinite: bool = False,
    reduce: bool = True,
    device: torch.device | None = None,
    owner: str = "",
) -> Tensor:
    """Clip ``grads`` in place by the ``norm_type``-norm of the gradient spread over the ranks of ``group``.

    Each rank holds a disjoint part of the gradient, so the global ``p``-norm is the ``p``-th root of the sum of the
    ranks' ``p``-th powers (the maximum for ``inf``): one scalar all-reduce. ``reduce=False`` (no partner ranks)
    skips it. Every rank gets the same coefficient. Returns the total norm; ``owner`` prefixes the error message.
    """
    grads = [g for g in grads if g.numel()]
    device = grads[0].device if grads else (device or torch.device("cpu"))
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        total = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
        total = total.reshape(1).clone()
        if reduce:
            comm.all_reduce(total, "max", group=group, label=label)
    else:
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for grad in grads:
            total += torch.linalg.vector_norm(grad.float(), norm_type) ** norm_type
        if reduce:
            comm.all_reduce(total, "sum", group=group, label=label)
        total = total ** (1.0 / norm_type)
    norm = total[0]
    if error_if_nonfinite and not torch.isfinite(norm):
        prefix = f"{owner}: " if owner else ""
        raise RuntimeError(f"{prefix}the gradient norm of order {norm_type} is {float(norm)}; nothing was clipped.")
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.dtype))
    return norm
