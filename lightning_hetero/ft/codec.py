"""A recovery checkpoint as bytes without pickle: one safetensors blob whose metadata is a JSON skeleton.

What a live replica sends a joining one (weights, optimizer state, momenta/error feedback, step, RNG) is a nested
structure of dicts, lists, tuples, tensors and plain scalars. :func:`encode_state` writes every tensor into a
safetensors blob (named by its path) and the structure as JSON in the blob's ``__metadata__``; nothing is pickled.

:func:`decode_state` is a decoder of peer bytes and keeps the rule of :mod:`lightning_hetero.comm.validation`. It
checks everything against the receiver's OWN state (:class:`StateLayout`, built from what the receiver would send
itself), before allocating anything for it:

- the blob size and the header size are bounded by what that layout allows;
- the skeleton has the same keys, container kinds, scalar types and strings as the receiver's, numbers are finite
  and at most ``MAX_PEER_MAGNITUDE``;
- every tensor has the receiver's dtype and shape at that path; per-parameter optimizer state (created lazily by
  torch optimizers, so possibly absent on a fresh receiver) may hold tensors of the parameter's shape or scalars,
  for the receiver's parameters only (:attr:`StateLayout.slot_paths`);
- tensor values are finite and at most ``MAX_PEER_MAGNITUDE``.

Anything else raises :class:`~lightning_hetero.comm.validation.PeerPayloadError` naming the peer and the field.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_hetero.comm.validation import (
    MAX_PEER_MAGNITUDE,
    PeerPayloadError,
    check_announced_size,
    check_values,
    peer_decoding,
)

__all__ = ["FORMAT", "StateLayout", "blob_limit", "decode_state", "encode_state"]

FORMAT = "lightning_hetero.ft/1"
"""Format tag written into every blob; a blob with another tag is refused."""
SKELETON_KEY = "lightning_hetero.ft.skeleton"
STEP_KEY = "lightning_hetero.ft.step"
MAX_SLOT_ENTRIES = 16
"""Most entries one parameter's optimizer state may hold (torch's Adam has 3, AMSGrad 4)."""
MAX_NAME_CHARS = 128
_HEADER_BYTES_PER_TENSOR = 512  # a header entry is ~100 bytes of JSON; generous, still bounded
_BASE_HEADER_BYTES = 1 << 20  # the skeleton (param_groups, RNG tuples) beyond the tensor entries
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_MAX_ITEMSIZE = 8

Path = tuple[Any, ...]


@dataclass(frozen=True)
class StateLayout:
    """What the receiver accepts: its own skeleton and tensor specs, and where lazily created per-parameter state may
    appear.

    Build it with :meth:`of` from the state the receiver would send itself.
    """

    skeleton: Any
    """The receiver's own state, tensors replaced by ``{"T": name}`` (see :func:`encode_state`)."""
    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
    """Path name -> (dtype, shape) of every tensor of the receiver's own state."""
    slot_paths: Mapping[Path, Mapping[Any, tuple[int, ...]]] = field(default_factory=dict)
    """Path of a per-parameter state dict -> {parameter key: parameter shape}; entries there may differ from the
    receiver's (a fresh optimizer has none yet), within the rule of the module docstring."""

    @classmethod
    def of(cls, state: Any, slot_paths: Mapping[Path, Mapping[Any, tuple[int, ...]]] | None = None) -> StateLayout:
        """The layout of ``state`` (the receiver's own), with optional per-parameter slot paths."""
        tensors: dict[str, torch.Tensor] = {}
        skeleton = _skeleton(state, (), tensors)
        specs = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()}
        return cls(skeleton, specs, {tuple(k): dict(v) for k, v in (slot_paths or {}).items()})

    def max_tensor_bytes(self) -> int:
        """Most tensor bytes a blob matching this layout can carry."""
        total = sum(math.prod(shape) * _itemsize(dtype) for dtype, shape in self.tensors.values())
        for params in self.slot_paths.values():
            total += sum(MAX_SLOT_ENTRIES * max(1, math.prod(shape)) * _MAX_ITEMSIZE for shape in params.values())
        return total

    def max_tensor_count(self) -> int:
        """Most tensors a blob matching this layout can carry."""
        return len(self.tensors) + sum(MAX_SLOT_ENTRIES * len(params) for params in self.slot_paths.values())

    def max_header_bytes(self) -> int:
        """Most header bytes (tensor entries plus the JSON skeleton) a blob matching this layout can need."""
        return _BASE_HEADER_BYTES + _HEADER_BYTES_PER_TENSOR * self.max_tensor_count()


def blob_limit(layout: StateLayout, extra_limit: int = 0) -> int:
    """Largest blob the receiver accepts: the layout's bound, lowered to ``extra_limit`` when that is set (> 0)."""
    limit = 8 + layout.max_header_bytes() + layout.max_tensor_bytes()
    return min(limit, extra_limit) if extra_limit > 0 else limit


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _name(path: Path) -> str:
    return "/".join(str(part) for part in path)


# ------------------------------------------------------------------------------------------------------- encode
def _skeleton(value: Any, path: Path, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able mirror of ``value``: dicts ``{"d": [[key, v], ...]}``, lists ``{"l": [...]}``, tuples ``{"t": ...}``,
    tensors ``{"T": name}``; None, bool, int, float and str as themselves."""
    if isinstance(value, torch.Tensor):
        name = _name(path)
        tensors[name] = value
        return {"T": name}
    if isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(f"state key {key!r} at {_name(path) or '<root>'} is not a str or int; cannot encode it")
            items.append([key, _skeleton(item, (*path, key), tensors)])
        return {"d": items}
    if isinstance(value, (list, tuple)):
        kind = "t" if isinstance(value, tuple) else "l"
        return {kind: [_skeleton(item, (*path, index), tensors) for index, item in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(
                f"state value at {_name(path)} is {value}; a recovery checkpoint holds finite numbers only"
            )
        return value
    raise TypeError(
        f"state value at {_name(path) or '<root>'} is a {type(value).__name__}; a recovery checkpoint holds tensors,"
        " dicts, lists, tuples, None, bool, int, float and str (convert it in the state_dict function)"
    )


def encode_state(state: Any, step: int) -> bytes:
    """``state`` (tensors on any device) as one safetensors blob with the JSON skeleton and ``step`` in its metadata."""
    from safetensors.torch import save  # lazy: only a sender or receiver of recoveries needs it

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _skeleton(state, (), tensors)
    cpu = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in tensors.items()}
    metadata = {"format": FORMAT, STEP_KEY: str(int(step)), SKELETON_KEY: json.dumps(skeleton, allow_nan=False)}
    return save(cpu, metadata=metadata)


# ------------------------------------------------------------------------------------------------------- decode
def _refuse_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name} (NaN/Infinity) is not allowed")


class _Decoder:
    """One decode of one blob from ``peer`` against ``layout``."""

    def __init__(self, layout: StateLayout, header: dict[str, Any], peer: int | None) -> None:
        self.layout = layout
        self.header = header
        self.peer = peer
        self.expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    def refuse(self, message: str, where: str) -> PeerPayloadError:
        return PeerPayloadError(
            f"recovery checkpoint from replica {self.peer}: {message}; refusing it.", self.peer, where
        )

    def number(self, value: Any, where: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise self.refuse(f"{where} is {value}, not finite", where)
        if abs(value) > MAX_PEER_MAGNITUDE:
            raise self.refuse(f"{where} has magnitude {float(abs(value)):.3g}, above {MAX_PEER_MAGNITUDE:.3g}", where)

    def tensor_ref(self, received: Any, where: str, allowed: list[tuple[torch.dtype, tuple[int, ...]]] | None) -> None:
        """Check a ``{"T": name}`` reference: the header entry exists once, its dtype/shape is allowed."""
        if not (isinstance(received, dict) and set(received) == {"T"} and isinstance(received["T"], str)):
            raise self.refuse(f"{where} is not a tensor reference", where)
        name = received["T"]
        entry = self.header.get(name)
        if name == "__metadata__" or not isinstance(entry, dict):
            raise self.refuse(f"{where} names tensor {name[:MAX_NAME_CHARS]!r}, absent from the blob", where)
        if name in self.expected:
            raise self.refuse(f"{where} reuses tensor {name[:MAX_NAME_CHARS]!r}", where)
        dtype = _DTYPES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
        shape = entry.get("shape")
        if dtype is None or not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise self.refuse(f"tensor {where} has dtype {entry.get('dtype')!r} / shape {shape!r}", where)
        spec = (dtype, tuple(shape))
        if allowed is not None and spec not in allowed:
            want = " or ".join(f"{_NAMES[d]} {list(s)}" for d, s in allowed)
            raise self.refuse(f"tensor {where} is {_NAMES[dtype]} {list(shape)}, this replica holds {want}", where)
        self.expected[name] = spec

    def walk(self, received: Any, template: Any, path: Path) -> Any:
        """Validate ``received`` against ``template`` (the receiver's own skeleton at ``path``)."""
        where = _name(path) or "<root>"
        if path in self.layout.slot_paths:
            return self.slots(received, path)
        if isinstance(template, dict):
            (kind,) = template
            if kind == "T":
                self.tensor_ref(received, where, [self.layout.tensors[template["T"]]])
                return received
            if not (isinstance(received, dict) and list(received) == [kind] and isinstance(received[kind], list)):
                raise self.refuse(f"{where} is not a {dict(d='dict', l='list', t='tuple')[kind]}", where)
            items, mine = received[kind], template[kind]
            if len(items) != len(mine):
                raise self.refuse(f"{where} has {len(items)} entries, this replica has {len(mine)}", where)
            if kind != "d":
                return {
                    kind: [
                        self.walk(item, own, (*path, i)) for i, (item, own) in enumerate(zip(items, mine, strict=True))
                    ]
                }
            own = {(type(key), key): value for key, value in mine}
            result = []
            for item in items:
                key = item[0] if isinstance(item, list) and len(item) == 2 else None
                if isinstance(key, bool) or not isinstance(key, (str, int)) or (type(key), key) not in own:
                    raise self.refuse(f"{where} holds a key this replica does not have ({str(item)[:80]})", where)
                result.append([key, self.walk(item[1], own.pop((type(key), key)), (*path, key))])
            return {"d": result}
        if type(received) is not type(template):
            raise self.refuse(
                f"{where} is a {type(received).__name__}, this replica has a {type(template).__name__}", where
            )
        if isinstance(template, str) and received != template:
            raise self.refuse(f"{where} is {received[:MAX_NAME_CHARS]!r}, this replica has {template!r}", where)
        if isinstance(template, (int, float)) and not isinstance(template, bool):
            self.number(received, where)
        return received

    def slots(self, received: Any, path: Path) -> Any:
        """Per-parameter state at ``path``: keys among the receiver's parameters, tensors of that shape or scalars."""
        where = _name(path)
        params = self.layout.slot_paths[path]
        if not (isinstance(received, dict) and list(received) == ["d"] and isinstance(received["d"], list)):
            raise self.refuse(f"{where} is not a dict", where)
        seen = set()
        for item in received["d"]:
            if not (isinstance(item, list) and len(item) == 2) or isinstance(item[0], bool) or item[0] not in params:
                raise self.refuse(f"{where} holds state for a parameter this replica does not have", where)
            if item[0] in seen:
                raise self.refuse(f"{where} repeats parameter {item[0]!r}", where)
            seen.add(item[0])
            shape = params[item[0]]
            allowed = [(dtype, s) for dtype in _DTYPES.values() for s in (shape, ())]
            entry_where = f"{where}/{item[0]}"
            value = item[1]
            if isinstance(value, dict) and list(value) == ["T"]:
                self.tensor_ref(value, entry_where, [(dtype, shape) for dtype in _DTYPES.values()])
                continue
            if not (isinstance(value, dict) and list(value) == ["d"] and isinstance(value["d"], list)):
                raise self.refuse(f"{entry_where} is neither a tensor nor a dict", entry_where)
            if len(value["d"]) > MAX_SLOT_ENTRIES:
                raise self.refuse(
                    f"{entry_where} has {len(value['d'])} entries, at most {MAX_SLOT_ENTRIES}", entry_where
                )
            for entry in value["d"]:
                if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
                    raise self.refuse(f"{entry_where} holds a malformed entry", entry_where)
                if len(entry[0]) > MAX_NAME_CHARS:
                    raise self.refuse(f"{entry_where} holds a key longer than {MAX_NAME_CHARS} characters", entry_where)
                inner = f"{entry_where}/{entry[0]}"
                if isinstance(entry[1], dict):
                    self.tensor_ref(entry[1], inner, allowed)
                elif entry[1] is None or isinstance(entry[1], bool):
                    continue
                elif isinstance(entry[1], (int, float)):
                    self.number(entry[1], inner)
                else:
                    raise self.refuse(f"{inner} is a {type(entry[1]).__name__}", inner)
        return received


def _rebuild(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        ((kind, body),) = skeleton.items()
        if kind == "T":
            return tensors[body]
        if kind == "d":
            return {key: _rebuild(value, tensors) for key, value in body}
        items = [_rebuild(value, tensors) for value in body]
        return tuple(items) if kind == "t" else items
    return skeleton


def decode_state(blob: bytes | bytearray | memoryview, layout: StateLayout, *, peer: int | None, step: int) -> Any:
    """Decode a blob of :func:`encode_state` from replica ``peer``, validated against the receiver's ``layout``.

    Args:
        blob: The bytes received.
        layout: The receiver's own state layout (:meth:`StateLayout.of`).
        peer: The sending replica (named in errors).
        step: The step the receiver asked for; the blob must carry it.

    Returns:
        The state, tensors on CPU, containers as the receiver's own (dicts, lists, tuples).

    Raises:
        PeerPayloadError: Anything in the blob breaks the rule of the module docstring.
    """
    with peer_decoding(peer, "recovery checkpoint"):
        data = memoryview(blob).cast("B")
        check_announced_size(len(data), blob_limit(layout), peer=peer, what="recovery checkpoint size", minimum=8)
        (header_size,) = struct.unpack("<Q", data[:8])
        header_size = check_announced_size(
            header_size, min(layout.max_header_bytes(), len(data) - 8), peer=peer, what="header size", minimum=2
        )
        try:
            header = json.loads(bytes(data[8 : 8 + header_size]), parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as error:
            raise PeerPayloadError(
                f"recovery checkpoint header from replica {peer} is not JSON ({error})", peer, "header"
            ) from error
        if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
            raise PeerPayloadError(f"recovery checkpoint from replica {peer} has no metadata", peer, "header")
        check_announced_size(len(header) - 1, layout.max_tensor_count(), peer=peer, what="tensor count")
        metadata = header["__metadata__"]
        if metadata.get("format") != FORMAT:
            raise PeerPayloadError(
                f"recovery checkpoint from replica {peer} has format {str(metadata.get('format'))[:40]!r}, expected"
                f" {FORMAT!r} (a peer running another lightning-hetero version?)",
                peer,
                "format",
            )
        if metadata.get(STEP_KEY) != str(step):
            raise PeerPayloadError(
                f"recovery checkpoint from replica {peer} is for step {str(metadata.get(STEP_KEY))[:20]}, asked for"
                f" step {step}",
                peer,
                "step",
            )
        skeleton_text = metadata.get(SKELETON_KEY)
        if not isinstance(skeleton_text, str):
            raise PeerPayloadError(f"recovery checkpoint from replica {peer} has no skeleton", peer, "skeleton")
        try:
            received = json.loads(skeleton_text, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as error:
            raise PeerPayloadError(
                f"recovery checkpoint skeleton from replica {peer} is not JSON ({error})", peer, "skeleton"
            ) from error
        decoder = _Decoder(layout, header, peer)
        received = decoder.walk(received, layout.skeleton, ())
        unused = sorted(set(header) - {"__metadata__"} - set(decoder.expected))
        if unused:
            raise decoder.refuse(f"the blob holds {len(unused)} tensor(s) the skeleton never uses", "tensors")
        body = data[8 + header_size :]
        tensors: dict[str, torch.Tensor] = {}
        spans = []
        for name, (dtype, shape) in decoder.expected.items():
            offsets = header[name].get("data_offsets")
            nbytes = math.prod(shape) * _itemsize(dtype)
            if not (
                isinstance(offsets, list)
                and len(offsets) == 2
                and all(type(o) is int for o in offsets)
                and 0 <= offsets[0]
                and offsets[1] - offsets[0] == nbytes
                and offsets[1] <= len(body)
            ):
                raise decoder.refuse(f"tensor {name[:MAX_NAME_CHARS]} has data offsets {str(offsets)[:60]}", name)
            spans.append(tuple(offsets))
            raw = bytes(body[offsets[0] : offsets[1]])
            tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            tensor = tensor.view(dtype).reshape(shape).clone()
            check_values(tensor.float() if tensor.dtype == torch.bool else tensor, peer=peer, what=name)
            tensors[name] = tensor
        spans.sort()
        if any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:], strict=False)):
            raise decoder.refuse("two tensors share bytes", "data_offsets")
        return _rebuild(received, tensors)
