"""The forged inputs of the hostile-input catalogue (``reliability_inputs.py``), one builder per attack.

Each builder forges one bad input for one decoder (FlexDeMo DeMo pieces, low-bit sparse lists, MatFormer schemas
and bucket names, malicious pickles and packed files, the issue-21 attacks, bad checkpoint manifests) and returns
what the code that would meet it in training makes of it (or a callable that does).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_hetero.comm import payload_packing
from lightning_hetero.comm.dump import load_ledger_dumps
from lightning_hetero.core import load_part, part_file
from lightning_hetero.matformer.compressed import _bucket_names
from lightning_hetero.matformer.schema import agree_on_schema, canonical_hash
from lightning_hetero.pipeline.boundary_codec import BoundaryCodec, pack_int8
from lightning_hetero.replication import build_replicator
from lightning_hetero.sparseflip.packing import load_packed
from lightning_hetero.sparseflip.sparse import decode_lists, mean_of_lists
from lightning_hetero.sparseflip.wire import decode_sparse, encode_sparse

NAN_F32 = [0, 0, 0xC0, 0x7F]
INF_F32 = [0, 0, 0x80, 0x7F]
NUMEL = 100
JSON_SCHEMA = {"error": (str, type(None)), "schema": (dict, type(None)), "schema_hash": (str, type(None))}


def byte_tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def random_bytes(seed: int, size: int) -> torch.Tensor:
    return torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


# ------------------------------------------------------------------------------------------------ FlexDeMo
def _demo() -> tuple[Any, Any]:
    replicator = build_replicator("demo", 1 / 32, chunk=32, values="fp32", index_bits=12)
    return replicator, replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))


def demo_gathered(forge: Callable[[torch.Tensor, Any], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        replicator, piece = _demo()
        return replicator.decode_gathered(piece, [piece.wire, forge(piece.wire.clone(), piece)])

    return run


def demo_index(wire: torch.Tensor, piece: Any) -> torch.Tensor:
    k = piece.meta["k"]
    forged = payload_packing.pack_indices(torch.full((k,), 4000), 12)  # blocks of 32x32 = 1024 coefficients
    return torch.cat((forged, wire[forged.numel() :]))


def with_tail(values: list[int]) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def forge(wire: torch.Tensor, piece: Any) -> torch.Tensor:
        wire[-4:] = byte_tensor(values)
        return wire

    return forge


def dense_reduced() -> torch.Tensor:
    replicator = build_replicator("random", 1 / 8, values="fp32")
    piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(1)))
    summed = piece.wire.clone().float()
    summed[0] = float("inf")
    return replicator.decode_reduced(piece, summed)


def dense_sign_scale() -> torch.Tensor:
    replicator = build_replicator("random", 1 / 8, values="sign")
    piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(2)))
    forged = piece.wire.clone()
    forged[-4:] = byte_tensor(NAN_F32)
    return replicator.decode_gathered(piece, [piece.wire, forged])


# ------------------------------------------------------------------------------------------------ low-bit
def sparse_message() -> torch.Tensor:
    return encode_sparse(torch.tensor([3, 40, 99]), torch.tensor([0.5, -1.0, 2.0]), NUMEL, "fp32")


def sparse_message_with(position: int, values: list[int]) -> torch.Tensor:
    message = sparse_message()
    message[position : position + len(values)] = byte_tensor(values)
    return message


def decode_sparse_message(message: torch.Tensor, encoding: str = "fp32") -> Any:
    return decode_sparse(message, NUMEL, encoding, peer=1)


# ------------------------------------------------------------------------------------------------ MatFormer
def schema_document(n_layer: int) -> dict[str, Any]:
    schema = {"model_type": "gpt2", "n_embd": 16, "n_layer": n_layer, "n_head": 2, "n_inner": 64}
    return {"error": None, "schema": schema, "schema_hash": canonical_hash(schema)}


def forged_hash() -> str:
    forged = schema_document(2)
    forged["schema"]["n_layer"] = 9  # edited after hashing
    return agree_on_schema([schema_document(2), forged])


def bucket_keys(text: str, numel: int) -> list[str]:
    return _bucket_names(torch.tensor(list(text.encode()), dtype=torch.uint8), 1, numel)


# ------------------------------------------------------------------------------------------------ pickle
class _Exploit:
    """Unpickling this would create ``marker``: what a crafted checkpoint does to ``torch.load(weights_only=False)``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.marker),))


def malicious_checkpoint() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        marker = Path(folder) / "owned"
        torch.save({"state_dict": {}, "payload": _Exploit(str(marker))}, part_file(folder, "rank_00000"))
        try:
            return load_part(folder, "rank_00000")
        finally:
            if marker.exists():
                raise RuntimeError("the malicious pickle ran: load_part executed code from the checkpoint")


def packed_file(byte: int | None, shape: list[int]) -> dict[str, torch.Tensor]:
    """A packed low-bit file of one layer (4 ternary codes in one byte), forged: ``byte`` and the recorded shape."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "packed.safetensors"
        if byte is None:
            path.write_bytes(b"\x80" * 64)  # a header length far beyond the file
        else:
            tensors = {"fc.codes.packed": byte_tensor([byte]), "fc.scale": torch.ones(1)}
            info = json.dumps({"kind": "ternary", "shape": shape, "format": "2bit"})
            save_file(tensors, str(path), metadata={"fc.codes.packed": info})
        return load_packed(path)


def ledger_dump(content: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "ledger-rank1-pid2.json").write_text(content)
        return load_ledger_dumps(folder)


# ------------------------------------------------------------------------------------------------ issue 21 attacks
class Refused(Exception):
    """Raised by a case whose code refused the bad input without raising (e.g. a resume skipped a bad checkpoint)."""


class CodeRan(Exception):
    """A crafted pickle ran code while loading: always ``crashed``, whatever the load raised afterwards."""


def demo_wire(values: str, forge: Callable[[torch.Tensor, Any], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A DeMo piece with ``values`` encoding, decoded and combined with a forged second replica."""

    def run() -> torch.Tensor:
        replicator = build_replicator("demo", 1 / 32, chunk=32, values=values, index_bits=12)
        piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))
        return replicator.decode_gathered(piece, [piece.wire, forge(piece.wire.clone(), piece)])

    return run


def huge_column(wire: torch.Tensor, piece: Any) -> torch.Tensor:
    """8 coefficients of 3.4e38 in column 0 of the 32x32 DCT block (finite alone, Inf once transformed back)."""
    k = piece.meta["k"]
    indices = torch.tensor([row * 32 for row in range(8)] + list(range(1, k - 7)))
    values = torch.zeros(k)
    values[:8] = 3.4e38
    return torch.cat((payload_packing.pack_indices(indices, 12), values.view(torch.uint8)))


def ternary_code_3(wire: torch.Tensor, piece: Any) -> torch.Tensor:
    start = piece.meta["index_bytes"]
    wire[start : start + piece.meta["k"] // 4] = 0xFF  # every 2-bit code 3
    return wire


def duplicate_indices(wire: torch.Tensor, piece: Any) -> torch.Tensor:
    k = piece.meta["k"]
    forged = payload_packing.pack_indices(torch.tensor([5, 5] + list(range(6, k + 4))), 12)
    return torch.cat((forged, wire[forged.numel() :]))


def two_huge_lists() -> torch.Tensor:
    message = encode_sparse(torch.tensor([5]), torch.tensor([3e38]), NUMEL, "fp32")
    return mean_of_lists(decode_lists([message, message.clone()], NUMEL, "fp32"), NUMEL, 2)


def int8_minus_128() -> torch.Tensor:
    codec = BoundaryCodec("int8", 4)
    wire = pack_int8(torch.ones(1, 1, 4))
    wire.view(torch.uint8)[0, 0, :4] = 0x80  # int8 -128, which the encoder never emits
    wire[0, 0, -1] = torch.finfo(torch.float32).max / 127 * 0.9999
    if hasattr(codec, "decode_received"):
        return codec.decode_received(wire, torch.float32, peer=0)
    codec.check_wire(wire, peer=0)
    return codec.decode(wire, torch.float32)


def layerwise_header() -> Any:
    """A stale asynchronous header (no local expectation for its step) announcing 4 GiB, at a stage whose own layout
    is batches of 8 x (16, 64) activations."""
    from lightning_hetero.layerwise.decoupled import ActivationLink

    link = ActivationLink(peer=1, codec="fp32", asynchronous=True)
    if hasattr(link, "allow_layout"):  # the receiver's own layout, recorded as training does before a header arrives
        link.allow_layout(8, (16, 64))
    # step 0, batch 1, fp32, sample (16, 2**26): 2**30 float32 values, 4 GiB for one message.
    return link.check_header(torch.tensor([0, 1, 0, 2, 16, 2**26, -1, -1]))


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    previous = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _strategy(kind: str) -> Any:
    if kind == "matformer":
        from lightning_hetero.strategies.matformer.trainer import MatFormerStrategy

        return MatFormerStrategy()
    if kind == "matformer-fabric":
        from lightning_hetero.strategies.matformer.fabric import MatFormerStrategy as FabricMatFormerStrategy

        return FabricMatFormerStrategy()
    from lightning_hetero.strategies.sparseflip.trainer import SparseFlipStrategy

    return SparseFlipStrategy()


def pickle_through_strategy(kind: str, force_env: bool, weights_only: bool | None) -> Callable[[], Any]:
    """A single-file checkpoint whose unpickling creates a marker file, loaded by the strategy's load path."""

    def run() -> Any:
        with tempfile.TemporaryDirectory() as folder:
            marker, path = Path(folder) / "owned", Path(folder) / "epoch=0-step=1.ckpt"
            torch.save({"state_dict": {}, "payload": _Exploit(str(marker))}, path)
            strategy = _strategy(kind)
            try:
                with _environment("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1" if force_env else None):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        if kind == "matformer-fabric":
                            return strategy.load_checkpoint(path, state={}, weights_only=weights_only)
                        return strategy.load_checkpoint(path, weights_only=weights_only)
            finally:
                if marker.exists():
                    raise CodeRan(f"the crafted pickle ran code: {kind} load_checkpoint created the marker file")

    return run


def flipped_bit_checkpoint() -> Any:
    from lightning_hetero.reliability import write_manifest

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "epoch=0-step=4.ckpt"
        torch.save({"state_dict": {"w": torch.zeros(256)}, "global_step": 4}, path)
        write_manifest(path, 4)
        data = bytearray(path.read_bytes())
        data[data.index(bytes(512)) + 256] ^= 0x10  # one bit inside the tensor's bytes: torch.load would not notice
        path.write_bytes(bytes(data))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _strategy("matformer").load_checkpoint(path)  # what Trainer.fit(ckpt_path=path) calls


def _checkpoint_folder(folder: Path, manifests: bool) -> tuple[Path, Path]:
    """An older good checkpoint (step 1) and a newer one (step 2), each with a manifest when ``manifests``."""
    from lightning_hetero.reliability import write_manifest

    paths = []
    for step in (1, 2):
        path = folder / f"epoch=0-step={step}.ckpt"
        torch.save({"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}, path)
        if manifests:
            write_manifest(path, step)
        paths.append(path)
    return paths[0], paths[1]


def bad_manifest(edit: Callable[[dict[str, Any]], None]) -> Callable[[], Any]:
    """The newer checkpoint's manifest edited; a resume must fall back to the older good one, not raise."""

    def run() -> Any:
        from lightning_hetero.reliability import latest_good_checkpoint, manifest_file

        with tempfile.TemporaryDirectory() as folder:
            good, bad = _checkpoint_folder(Path(folder), manifests=True)
            manifest = json.loads(manifest_file(bad).read_text())
            edit(manifest)
            manifest_file(bad).write_text(json.dumps(manifest))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found = latest_good_checkpoint(folder)
            if found == good:
                raise Refused(f"skipped {bad.name} (malformed manifest) and resumed from {good.name}")
            return str(found)

    return run


def manifests_gone() -> Any:
    from lightning_hetero.reliability import latest_good_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        _checkpoint_folder(Path(folder), manifests=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return latest_good_checkpoint(folder)  # None here would be a silent start from step 0
