"""Hostile and corrupt input against every decoder that reads peer bytes or checkpoint files: a catalogue.

Each case forges one bad input (out-of-range index, wrong length, NaN/Inf, finite values that overflow once decoded
or combined, invalid codes and scales, repeated indices, announced sizes beyond what the receiver's layout allows,
another schema, truncated bytes, a checkpoint carrying a malicious pickle, a malformed or missing manifest, a flipped
bit) and feeds it to the code that would meet it in training; random-bytes cases try each decoder family. The
outcome of a case is exactly one of:

- ``rejected``: the decoder refused it: ``PeerPayloadError`` or another ``ValueError``, ``UnpicklingError`` for a
  pickle, or an error class of this project (e.g. ``NoGoodCheckpointError``); a newer checkpoint with a bad manifest
  counts as rejected when the resume falls back to the older good one;
- ``accepted_valid``: random bytes that happen to form a valid message: what was decoded is finite, at most
  ``MAX_PEER_MAGNITUDE`` and of the announced layout (indistinguishable from an honest peer, so accepting it is
  correct). A forged input is invalid by construction and can never be accepted as valid;
- ``accepted_invalid``: accepted with invalid content (a forged input accepted at all, e.g. Inf after combining, a
  ternary code 3 or a negative scale applied, repeated indices, a 4 GiB header, a silent fresh start);
- ``crashed``: any other exception escaped (a RuntimeError, KeyError, a hang cut by the timeout), or a crafted
  pickle ran code (its marker file appeared).

The two collective gathers (subspace export, MatFormer error feedback) run in one subprocess with 2 spawned gloo
ranks, one of them forging, under a timeout; nothing allocates gigabytes for real (announced sizes are refused before
allocating, or an allocation stays virtual and the timeout ends the wait). About a minute on 2 cores. Writes
``docs/results/reliability_inputs.json``::

    python recipes/reliability_inputs.py [--random-cases 25] [--out docs/results/reliability_inputs.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_hetero.comm import payload_packing
from lightning_hetero.comm.dump import load_ledger_dumps
from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError
from lightning_hetero.core import load_part, part_file
from lightning_hetero.core.state import decode_json_payload
from lightning_hetero.lowbit.packing import load_packed
from lightning_hetero.lowbit.sparse import decode_lists, mean_of_lists
from lightning_hetero.lowbit.wire import decode_flips, decode_sparse, encode_flips, encode_sparse
from lightning_hetero.matformer.aggregate import _check_reduced
from lightning_hetero.matformer.compressed import _bucket_names, decode_error_feedback
from lightning_hetero.matformer.schema import SchemaMismatchError, agree_on_schema, canonical_hash
from lightning_hetero.pipeline.boundary_codec import BoundaryCodec, pack_int8
from lightning_hetero.pipeline.stage_gather import decode_stage_state
from lightning_hetero.replication import build_replicator

REPO = Path(__file__).resolve().parents[1]
REFUSALS = (PeerPayloadError, SchemaMismatchError, ValueError, pickle.UnpicklingError)
GATHER_TIMEOUT = 90.0  # seconds for the subprocess running both spawned gathers
NAN_F32 = [0, 0, 0xC0, 0x7F]
INF_F32 = [0, 0, 0x80, 0x7F]
NUMEL = 100
JSON_SCHEMA = {"error": (str, type(None)), "schema": (dict, type(None)), "schema_hash": (str, type(None))}


def _bytes(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def _random(seed: int, size: int) -> torch.Tensor:
    return torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


# ------------------------------------------------------------------------------------------------ FlexDeMo
def _demo() -> tuple[Any, Any]:
    replicator = build_replicator("demo", 1 / 32, chunk=32, values="fp32", index_bits=12)
    return replicator, replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))


def _demo_gathered(forge: Callable[[torch.Tensor, Any], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        replicator, piece = _demo()
        return replicator.decode_gathered(piece, [piece.wire, forge(piece.wire.clone(), piece)])

    return run


def _demo_index(wire: torch.Tensor, piece: Any) -> torch.Tensor:
    k = piece.meta["k"]
    forged = payload_packing.pack_indices(torch.full((k,), 4000), 12)  # blocks of 32x32 = 1024 coefficients
    return torch.cat((forged, wire[forged.numel() :]))


def _with_tail(values: list[int]) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def forge(wire: torch.Tensor, piece: Any) -> torch.Tensor:
        wire[-4:] = _bytes(values)
        return wire

    return forge


def _dense_reduced() -> torch.Tensor:
    replicator = build_replicator("random", 1 / 8, values="fp32")
    piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(1)))
    summed = piece.wire.clone().float()
    summed[0] = float("inf")
    return replicator.decode_reduced(piece, summed)


def _dense_sign_scale() -> torch.Tensor:
    replicator = build_replicator("random", 1 / 8, values="sign")
    piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(2)))
    forged = piece.wire.clone()
    forged[-4:] = _bytes(NAN_F32)
    return replicator.decode_gathered(piece, [piece.wire, forged])


# ------------------------------------------------------------------------------------------------ low-bit
def _sparse() -> torch.Tensor:
    return encode_sparse(torch.tensor([3, 40, 99]), torch.tensor([0.5, -1.0, 2.0]), NUMEL, "fp32")


def _sparse_with(position: int, values: list[int]) -> torch.Tensor:
    message = _sparse()
    message[position : position + len(values)] = _bytes(values)
    return message


def _decode(message: torch.Tensor, encoding: str = "fp32") -> Any:
    return decode_sparse(message, NUMEL, encoding, peer=1)


# ------------------------------------------------------------------------------------------------ MatFormer
def _schema_document(n_layer: int) -> dict[str, Any]:
    schema = {"model_type": "gpt2", "n_embd": 16, "n_layer": n_layer, "n_head": 2, "n_inner": 64}
    return {"error": None, "schema": schema, "schema_hash": canonical_hash(schema)}


def _forged_hash() -> str:
    forged = _schema_document(2)
    forged["schema"]["n_layer"] = 9  # edited after hashing
    return agree_on_schema([_schema_document(2), forged])


def _keys(text: str, numel: int) -> list[str]:
    return _bucket_names(torch.tensor(list(text.encode()), dtype=torch.uint8), 1, numel)


# ------------------------------------------------------------------------------------------------ pickle
class _Exploit:
    """Unpickling this would create ``marker``: what a crafted checkpoint does to ``torch.load(weights_only=False)``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.marker),))


def _malicious_checkpoint() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        marker = Path(folder) / "owned"
        torch.save({"state_dict": {}, "payload": _Exploit(str(marker))}, part_file(folder, "rank_00000"))
        try:
            return load_part(folder, "rank_00000")
        finally:
            if marker.exists():
                raise RuntimeError("the malicious pickle ran: load_part executed code from the checkpoint")


def _packed_file(byte: int | None, shape: list[int]) -> dict[str, torch.Tensor]:
    """A packed low-bit file of one layer (4 ternary codes in one byte), forged: ``byte`` and the recorded shape."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "packed.safetensors"
        if byte is None:
            path.write_bytes(b"\x80" * 64)  # a header length far beyond the file
        else:
            tensors = {"fc.codes.packed": _bytes([byte]), "fc.scale": torch.ones(1)}
            info = json.dumps({"kind": "ternary", "shape": shape, "format": "2bit"})
            save_file(tensors, str(path), metadata={"fc.codes.packed": info})
        return load_packed(path)


def _ledger_dump(content: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "ledger-rank1-pid2.json").write_text(content)
        return load_ledger_dumps(folder)


# ------------------------------------------------------------------------------------------------ issue 21 attacks
class Refused(Exception):
    """Raised by a case whose code refused the bad input without raising (e.g. a resume skipped a bad checkpoint)."""


class CodeRan(Exception):
    """A crafted pickle ran code while loading: always ``crashed``, whatever the load raised afterwards."""


def _demo_wire(values: str, forge: Callable[[torch.Tensor, Any], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A DeMo piece with ``values`` encoding, decoded and combined with a forged second replica."""

    def run() -> torch.Tensor:
        replicator = build_replicator("demo", 1 / 32, chunk=32, values=values, index_bits=12)
        piece = replicator.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))
        return replicator.decode_gathered(piece, [piece.wire, forge(piece.wire.clone(), piece)])

    return run


def _huge_column(wire: torch.Tensor, piece: Any) -> torch.Tensor:
    """8 coefficients of 3.4e38 in column 0 of the 32x32 DCT block (finite alone, Inf once transformed back)."""
    k = piece.meta["k"]
    indices = torch.tensor([row * 32 for row in range(8)] + list(range(1, k - 7)))
    values = torch.zeros(k)
    values[:8] = 3.4e38
    return torch.cat((payload_packing.pack_indices(indices, 12), values.view(torch.uint8)))


def _ternary_code_3(wire: torch.Tensor, piece: Any) -> torch.Tensor:
    start = piece.meta["index_bytes"]
    wire[start : start + piece.meta["k"] // 4] = 0xFF  # every 2-bit code 3
    return wire


def _duplicate_indices(wire: torch.Tensor, piece: Any) -> torch.Tensor:
    k = piece.meta["k"]
    forged = payload_packing.pack_indices(torch.tensor([5, 5] + list(range(6, k + 4))), 12)
    return torch.cat((forged, wire[forged.numel() :]))


def _two_huge_lists() -> torch.Tensor:
    message = encode_sparse(torch.tensor([5]), torch.tensor([3e38]), NUMEL, "fp32")
    return mean_of_lists(decode_lists([message, message.clone()], NUMEL, "fp32"), NUMEL, 2)


def _int8_minus_128() -> torch.Tensor:
    codec = BoundaryCodec("int8", 4)
    wire = pack_int8(torch.ones(1, 1, 4))
    wire.view(torch.uint8)[0, 0, :4] = 0x80  # int8 -128, which the encoder never emits
    wire[0, 0, -1] = torch.finfo(torch.float32).max / 127 * 0.9999
    if hasattr(codec, "decode_received"):
        return codec.decode_received(wire, torch.float32, peer=0)
    codec.check_wire(wire, peer=0)
    return codec.decode(wire, torch.float32)


def _layerwise_header() -> Any:
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
    from lightning_hetero.strategies.lowbit.trainer import SparseFlipStrategy

    return SparseFlipStrategy()


def _pickle_through_strategy(kind: str, force_env: bool, weights_only: bool | None) -> Callable[[], Any]:
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


def _flipped_bit_checkpoint() -> Any:
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


def _bad_manifest(edit: Callable[[dict[str, Any]], None]) -> Callable[[], Any]:
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


def _manifests_gone() -> Any:
    from lightning_hetero.reliability import latest_good_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        _checkpoint_folder(Path(folder), manifests=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return latest_good_checkpoint(folder)  # None here would be a silent start from step 0


# ------------------------------------------------------------------------------------------------ spawned gathers
GATHER_CASES = {
    "subspace export gather": ["negative size", "2**50 size", "bogus safetensors", "NaN weights"],
    "matformer error-feedback gather": ["numel 2**31"],
}
_EF_KEY = "0,1|float32|8"


def _subspace_forgery(kind: str) -> tuple[int, bytes | None]:
    from safetensors.torch import save as save_safetensors

    if kind == "negative size":
        return -5, None
    if kind == "2**50 size":
        return 2**50, None
    if kind == "bogus safetensors":
        return 64, b"\x80" * 64
    payload = save_safetensors({"w": torch.tensor([1.0, float("nan")])})
    return len(payload), payload


def _gather_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 forges what a stage (or a MatFormer rank) sends; rank 0 runs the real gather. One verdict per case."""
    from lightning_hetero import comm
    from lightning_hetero.matformer.compressed import CHECKPOINT_LABEL, CompressedExchange
    from lightning_hetero.matformer.layout import widths_for
    from lightning_hetero.matformer.region_groups import RegionGroups
    from lightning_hetero.pipeline.layout import PipelineLayout
    from lightning_hetero.pipeline.stage_gather import EXPORT_LABEL, gather_stage_states

    verdicts: dict[str, Any] = {}

    def verdict(name: str, call: Callable[[], Any]) -> None:
        try:
            verdicts[name] = ("accepted", repr(call())[:200])
        except PeerPayloadError as error:
            verdicts[name] = ("refused", f"PeerPayloadError: {error}"[:300])
        except Exception as error:  # noqa: BLE001 - reported as a crash by the parent
            verdicts[name] = ("escaped", f"{type(error).__name__}: {error}"[:300])

    layout = PipelineLayout(num_stages=2)
    for kind in GATHER_CASES["subspace export gather"]:
        if rank == 1:
            size, payload = _subspace_forgery(kind)
            comm.send(torch.tensor([size], dtype=torch.int64), 0, label=EXPORT_LABEL)
            if payload is not None:
                comm.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, label=EXPORT_LABEL)
            continue
        verdict(kind, lambda: gather_stage_states({"v": torch.ones(2)}, layout, 0, torch.device("cpu")))
    exchange = CompressedExchange(RegionGroups(widths_for([0, 0], 16)), 1 / 8)
    exchange.load_state_dict({_EF_KEY: torch.zeros(8)})
    if rank == 1:  # announces 2**31 values (8 GiB) and sends nothing
        every = torch.empty(4, dtype=torch.int64)
        sizes = torch.tensor([len(json.dumps([_EF_KEY])), 2**31])
        comm.all_gather_into_tensor(every, sizes, label=CHECKPOINT_LABEL)
    else:
        verdict("numel 2**31", lambda: exchange.gather_state(torch.device("cpu")))
    return verdicts


def _gather_main() -> None:
    """``--gather-worker``: run the spawned gathers and print rank 0's verdicts as JSON (run by :func:`_gathers`)."""
    from lightning_hetero.testing import run_distributed

    print(json.dumps(run_distributed(_gather_worker, 2, timeout=GATHER_TIMEOUT - 15)[0]))


@functools.cache
def _gathers() -> dict[str, Any]:
    """Rank 0's verdict for every gather case, or ``{"error": ...}`` when the run failed or hung."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--gather-worker"],
            capture_output=True,
            text=True,
            timeout=GATHER_TIMEOUT,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"TimeoutError: the spawned gathers did not finish in {GATHER_TIMEOUT:.0f} s (a rank waits)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the spawned gathers failed (exit {done.returncode}): {tail}"}
    return json.loads(lines[-1])


def _gather_case(kind: str) -> Callable[[], Any]:
    def run() -> Any:
        verdicts = _gathers()
        if "error" in verdicts:
            raise RuntimeError(verdicts["error"])
        outcome, detail = verdicts[kind]
        if outcome == "refused":
            raise PeerPayloadError(detail.removeprefix("PeerPayloadError: "))
        if outcome == "escaped":
            raise RuntimeError(f"escaped the gather: {detail}")
        return detail

    return run


# ------------------------------------------------------------------------------------------------ validity
def _valid(result: Any) -> bool:
    """Whether an accepted result is harmless: finite floats of magnitude at most ``MAX_PEER_MAGNITUDE``."""
    if isinstance(result, torch.Tensor):
        if not result.is_floating_point() or not result.numel():
            return True
        return bool(torch.isfinite(result).all()) and float(result.abs().max()) <= MAX_PEER_MAGNITUDE
    if isinstance(result, dict):
        return all(_valid(item) for item in result.values())
    if isinstance(result, (list, tuple)):
        return all(_valid(item) for item in result)
    return True


def _forged(result: Any) -> bool:
    """A forged input is invalid by construction: accepting it at all is ``accepted_invalid``."""
    return False


def _shaped(shape: tuple[int, ...]) -> Callable[[Any], bool]:
    return lambda out: _valid(out) and isinstance(out, torch.Tensor) and tuple(out.shape) == shape


def _ef_layout(out: Any) -> bool:
    return _valid(out) and all(key == _EF_KEY and value.numel() == 8 for key, value in out.items())


def catalogue(random_cases: int) -> list[tuple[str, str, Callable[[], Any], Callable[[Any], bool]]]:
    """``(decoder, bad input, run, is_valid)`` for every case."""
    sparse_body = 4 + payload_packing.index_nbytes(3, 12)
    index_ok = lambda out: all(int(i.max()) < NUMEL for i, _ in out if i.numel()) if isinstance(out, list) else True  # noqa: E731
    cases: list[tuple[str, str, Callable[[], Any], Callable[[Any], bool]]] = [
        ("flexdemo DeMo decode_gathered", "out-of-range coefficient index", _demo_gathered(_demo_index), _forged),
        ("flexdemo DeMo decode_gathered", "NaN value", _demo_gathered(_with_tail(NAN_F32)), _forged),
        ("flexdemo DeMo decode_gathered", "Inf value", _demo_gathered(_with_tail(INF_F32)), _forged),
        ("flexdemo DeMo decode_gathered", "truncated bytes", _demo_gathered(lambda w, p: w[:-3]), _forged),
        ("flexdemo random(sign) decode_gathered", "NaN scale", _dense_sign_scale, _forged),
        ("flexdemo random decode_reduced", "Inf in the all-reduced sum", _dense_reduced, _forged),
        (
            "comm.payload_packing unpack_indices",
            "truncated bytes",
            lambda: payload_packing.unpack_indices(_bytes([1, 2]), 4, 12),
            _forged,
        ),
        (
            "comm.payload_packing unpack_values",
            "wrong length",
            lambda: payload_packing.unpack_values(_bytes([0] * 7), 1, 2, "fp32"),
            _forged,
        ),
        ("lowbit decode_sparse", "NaN value", lambda: _decode(_sparse_with(sparse_body, NAN_F32)), _forged),
        ("lowbit decode_sparse", "Inf value", lambda: _decode(_sparse_with(sparse_body + 4, INF_F32)), _forged),
        (
            "lowbit decode_sparse",
            "out-of-range index",
            lambda: decode_sparse(
                encode_sparse(torch.tensor([3, 40, 150]), torch.ones(3), 4096, "fp32"), NUMEL, "fp32", peer=1
            ),
            _forged,
        ),
        (
            "lowbit decode_sparse",
            "indices not increasing",
            lambda: _decode(
                torch.cat(
                    (
                        _sparse()[:4],
                        payload_packing.pack_indices(torch.tensor([40, 3, 99]), 12),
                        _sparse()[sparse_body:],
                    )
                )
            ),
            _forged,
        ),
        ("lowbit decode_sparse", "truncated bytes", lambda: _decode(_sparse()[:-1]), _forged),
        ("lowbit decode_sparse", "trailing bytes", lambda: _decode(torch.cat((_sparse(), _bytes([0])))), _forged),
        ("lowbit decode_sparse", "count above numel", lambda: _decode(_bytes([0xFF, 0xFF, 0, 0])), _forged),
        (
            "lowbit decode_sparse",
            "negative sign scale",
            lambda: _decode(
                torch.cat(
                    (
                        encode_sparse(torch.tensor([1]), torch.ones(1), NUMEL, "sign")[:-4],
                        torch.tensor([-1.0]).view(torch.uint8),
                    )
                ),
                "sign",
            ),
            _forged,
        ),
        (
            "lowbit decode_flips",
            "out-of-range index",
            lambda: decode_flips(encode_flips(torch.tensor([150]), torch.ones(1), 4096), NUMEL, peer=0),
            _forged,
        ),
        (
            "lowbit decode_flips",
            "truncated bytes",
            lambda: decode_flips(encode_flips(torch.tensor([5, 9]), torch.ones(2), NUMEL)[:-1], NUMEL, peer=0),
            _forged,
        ),
        (
            "matformer setup agree_on_schema",
            "different schema",
            lambda: agree_on_schema([_schema_document(2), _schema_document(3)]),
            _forged,
        ),
        ("matformer setup agree_on_schema", "schema hash not matching its schema", _forged_hash, _forged),
        (
            "matformer aggregate (all-reduced bucket)",
            "NaN gradient",
            lambda: _check_reduced(torch.tensor([1.0, float("nan")]), (0, 1), "raise"),
            _forged,
        ),
        ("matformer checkpoint gather (bucket keys)", "not JSON", lambda: _keys("[1", 10), _forged),
        (
            "matformer checkpoint gather (bucket keys)",
            "keys not covering the values",
            lambda: _keys('["0,1|float32|6"]', 10),
            _forged,
        ),
        ("core all_gather_json", "not UTF-8", lambda: decode_json_payload(b"\xff\xfe", 1, JSON_SCHEMA), _forged),
        (
            "core all_gather_json",
            "NaN constant",
            lambda: decode_json_payload(b'{"error": NaN, "schema": null, "schema_hash": null}', 1, JSON_SCHEMA),
            _forged,
        ),
        (
            "core all_gather_json",
            "wrong keys",
            lambda: decode_json_payload(b'{"error": null}', 1, JSON_SCHEMA),
            _forged,
        ),
        (
            "core all_gather_json",
            "wrong value type",
            lambda: decode_json_payload(b'{"error": 3, "schema": null, "schema_hash": null}', 1, JSON_SCHEMA),
            _forged,
        ),
        ("core all_gather_json", "nesting bomb", lambda: decode_json_payload(b"[" * 100_000, 1, JSON_SCHEMA), _forged),
        (
            "subspace boundary codec",
            "NaN activation (fp32)",
            lambda: BoundaryCodec("fp32", 4).check_wire(torch.tensor([[[0.0, float("nan"), 1.0, 2.0]]]), peer=0),
            _forged,
        ),
        (
            "subspace boundary codec",
            "Inf gradient (bf16)",
            lambda: BoundaryCodec("bf16", 2).check_wire(
                torch.tensor([[[float("inf"), 1.0]]], dtype=torch.bfloat16), peer=2
            ),
            _forged,
        ),
        (
            "subspace boundary codec",
            "negative int8 scale",
            lambda: BoundaryCodec("int8", 4).check_wire(
                pack_int8(torch.ones(1, 1, 4)) * torch.tensor([1.0, -1.0]), peer=0
            ),
            _forged,
        ),
        (
            "subspace boundary codec",
            "overflowing int8 scale",
            lambda: BoundaryCodec("int8", 4).check_wire(
                torch.cat((pack_int8(torch.ones(1, 1, 4))[..., :1], torch.full((1, 1, 1), 3e38)), -1), peer=0
            ),
            _forged,
        ),
        (
            "subspace boundary codec",
            "wrong width",
            lambda: BoundaryCodec("fp32", 4).check_wire(torch.zeros(1, 1, 3), peer=0),
            _forged,
        ),
        ("core checkpoint part (torch.load weights_only=True)", "malicious pickle", _malicious_checkpoint, _forged),
        ("lowbit load_packed (safetensors)", "invalid 2-bit code", lambda: _packed_file(0xFF, [4]), _forged),
        ("lowbit load_packed (safetensors)", "shape not matching the bytes", lambda: _packed_file(0x00, [9]), _forged),
        ("lowbit load_packed (safetensors)", "not a safetensors file", lambda: _packed_file(None, [4]), _forged),
        ("testbed ledger dumps", "truncated JSON (killed rank)", lambda: _ledger_dump('{"rank": 0, "pi'), _forged),
        ("testbed ledger dumps", "wrong field types", lambda: _ledger_dump('{"rank": "0", "pid": []}'), _forged),
        # Issue 21: the attacks found by trying the system as an attacker would.
        *(
            (
                f"{kind} load_checkpoint (single file)",
                f"malicious pickle, {how}",
                _pickle_through_strategy(*args),
                _forged,
            )
            for kind, how, args in (
                ("matformer", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1", ("matformer", True, None)),
                ("matformer", "weights_only=False", ("matformer", False, False)),
                ("sparseflip", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1", ("sparseflip", True, None)),
                ("sparseflip", "weights_only=False", ("sparseflip", False, False)),
                ("matformer fabric", "weights_only=False", ("matformer-fabric", False, False)),
            )
        ),
        (
            "flexdemo DeMo decode_gathered (2 replicas)",
            "8 DCT coefficients of 3.4e38 in one column",
            _demo_wire("fp32", _huge_column),
            _forged,
        ),
        (
            "flexdemo DeMo decode_gathered (2 replicas)",
            "ternary code 3",
            _demo_wire("ternary", _ternary_code_3),
            _forged,
        ),
        (
            "flexdemo DeMo decode_gathered (2 replicas)",
            "negative sign scale",
            _demo_wire("sign", _with_tail(list(torch.tensor([-1.0]).view(torch.uint8).tolist()))),
            _forged,
        ),
        (
            "flexdemo DeMo decode_gathered (2 replicas)",
            "negative ternary scale",
            _demo_wire("ternary", _with_tail(list(torch.tensor([-1.0]).view(torch.uint8).tolist()))),
            _forged,
        ),
        (
            "flexdemo DeMo decode_gathered (2 replicas)",
            "duplicate indices",
            _demo_wire("fp32", _duplicate_indices),
            _forged,
        ),
        ("lowbit fp lists mean_of_lists", "two finite 3e38 fp lists combined", _two_huge_lists, _forged),
        (
            "subspace boundary codec",
            "int8 byte -128 with a scale just under float32 max / 127",
            _int8_minus_128,
            _forged,
        ),
        ("layerwise async header (check_header)", "4 GiB announced for one message", _layerwise_header, _forged),
        *((decoder, kind, _gather_case(kind), _forged) for decoder, kinds in GATHER_CASES.items() for kind in kinds),
        (
            "reliability latest_good_checkpoint",
            "newer manifest without step",
            _bad_manifest(lambda m: m.pop("step")),
            _forged,
        ),
        (
            "reliability latest_good_checkpoint",
            "newer manifest with a non-integer step",
            _bad_manifest(lambda m: m.update(step="2")),
            _forged,
        ),
        (
            "reliability latest_good_checkpoint",
            "newer manifest of another version",
            _bad_manifest(lambda m: m.update(version=99)),
            _forged,
        ),
        ("reliability latest_good_checkpoint", "every manifest gone", _manifests_gone, _forged),
        ("matformer load_checkpoint (ckpt_path)", "one flipped bit, with a manifest", _flipped_bit_checkpoint, _forged),
        (
            "core all_gather_json",
            "1e999 (parses to inf)",
            lambda: decode_json_payload(
                b'{"error": null, "schema": {"n": 1e999}, "schema_hash": null}', 1, JSON_SCHEMA
            ),
            _forged,
        ),
        (
            "core all_gather_json",
            "duplicate keys",
            lambda: decode_json_payload(
                b'{"error": null, "error": "x", "schema": null, "schema_hash": null}', 1, JSON_SCHEMA
            ),
            _forged,
        ),
        ("lowbit load_packed (safetensors)", "negative shape", lambda: _packed_file(0x00, [-4]), _forged),
    ]
    # Issue 33: recovery blobs of the fault-tolerant path (recipes/ft_inputs.py).
    spec = importlib.util.spec_from_file_location("ft_inputs", REPO / "recipes" / "ft_inputs.py")
    ft_cases = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(ft_cases)  # type: ignore[union-attr]
    cases.extend(ft_cases.recovery_cases(random_cases))
    for seed in range(random_cases):
        cases.append(
            (
                "flexdemo DeMo decode_gathered",
                f"random bytes (seed {seed})",
                _demo_gathered(lambda w, p, seed=seed: _random(seed, w.numel())),
                _shaped((32, 32)),
            )
        )
        cases.append(
            (
                "lowbit decode_lists",
                f"random bytes (seed {seed})",
                lambda seed=seed: decode_lists([_random(seed, 4 + seed)], NUMEL, "bf16"),
                lambda out: _valid(out) and index_ok(out),
            )
        )
        cases.append(
            (
                "core all_gather_json",
                f"random bytes (seed {seed})",
                lambda seed=seed: decode_json_payload(bytes(_random(seed, 24).tolist()), 1, JSON_SCHEMA),
                _valid,
            )
        )
        cases.append(
            (
                "subspace boundary codec (int8)",
                f"random bytes (seed {seed})",
                lambda seed=seed: (
                    BoundaryCodec("int8", 8).check_wire(
                        w := _random(seed, 48).view(torch.float32).reshape(1, 4, 3), peer=1
                    ),
                    BoundaryCodec("int8", 8).decode(w, torch.float32),
                )[1],
                _shaped((1, 4, 8)),
            )
        )
        cases.append(
            (
                "subspace export decode_stage_state",
                f"random bytes (seed {seed})",
                lambda seed=seed: decode_stage_state(bytes(_random(seed, 16 + 8 * seed).tolist()), peer=1),
                _valid,
            )
        )
        cases.append(
            (
                "matformer decode_error_feedback",
                f"random bytes (seed {seed})",
                lambda seed=seed: decode_error_feedback(
                    _random(seed, 18), _random(seed + 1000, 32).view(torch.float32), source=1, allowed={_EF_KEY}
                ),
                _ef_layout,
            )
        )
    return cases


def _message(error: BaseException) -> str:
    """The error's class and message, without the random temporary folder names (so reruns give the same file)."""
    text = re.sub(re.escape(tempfile.gettempdir()) + r"/tmp\w+", "<tmpdir>", str(error))
    return f"{type(error).__name__}: {text[:200]}"


def _refusal(error: BaseException) -> bool:
    """The decoder's own refusal: a ValueError (PeerPayloadError included), UnpicklingError, or an error class of
    this project (e.g. ``NoGoodCheckpointError``). Anything else escaping is a crash."""
    if isinstance(error, CodeRan):
        return False
    return isinstance(error, (*REFUSALS, Refused)) or type(error).__module__.startswith("lightning_hetero.")


def run(random_cases: int) -> dict[str, Any]:
    """Every case's outcome and the five totals: tried = rejected + accepted_valid + accepted_invalid + crashed."""
    records = []
    for decoder, bad_input, call, is_valid in catalogue(random_cases):
        record: dict[str, Any] = {"decoder": decoder, "input": bad_input}
        try:
            result = call()
            record["outcome"] = "accepted_valid" if is_valid(result) else "accepted_invalid"
        except Exception as error:  # noqa: BLE001 - a crash is what the catalogue looks for
            record["outcome"] = "rejected" if _refusal(error) else "crashed"
            record["error"] = _message(error)
        records.append(record)
    outcomes = [r["outcome"] for r in records]
    forged = [r for r in records if not r["input"].startswith("random bytes")]
    return {
        "command": f"python recipes/reliability_inputs.py --random-cases {random_cases}",
        "bad_inputs_tried": len(records),
        "bad_inputs_rejected": outcomes.count("rejected"),
        "accepted_valid": outcomes.count("accepted_valid"),
        "accepted_invalid": outcomes.count("accepted_invalid"),
        "crashed": outcomes.count("crashed"),
        "forged_inputs_tried": len(forged),
        "forged_inputs_rejected": sum(r["outcome"] == "rejected" for r in forged),
        "cases": records,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-cases", type=int, default=25, help="random-bytes cases per decoder")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "reliability_inputs.json")
    parser.add_argument("--gather-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gather_worker:
        _gather_main()
        return
    result = run(args.random_cases)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k != "cases"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
