"""Hostile and corrupt input against every decoder that reads peer bytes or checkpoint files: a catalogue.

Each case forges one bad input (out-of-range index, wrong length, NaN/Inf, another schema, truncated bytes, random
bytes, a checkpoint carrying a malicious pickle) and feeds it to the decoder that would meet it in training. The
outcome of a case is one of:

- ``rejected``: the decoder raised its refusal (``PeerPayloadError``, ``SchemaMismatchError``, ``ValueError`` from
  a codec, ``UnpicklingError`` for the pickle);
- ``accepted_valid``: random bytes that happen to form a valid payload (every index in range, every value finite);
  indistinguishable from an honest peer, so accepting them is correct;
- ``accepted_invalid`` / ``crashed``: a failure of this project (never expected).

Single process, CPU, a few seconds. Writes ``docs/results/reliability_inputs.json``::

    python recipes/reliability_inputs.py [--random-cases 25] [--out docs/results/reliability_inputs.json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_hetero.comm import codecs
from lightning_hetero.comm.dump import load_ledger_dumps
from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.core import load_part, part_file
from lightning_hetero.core.state import decode_json_payload
from lightning_hetero.flexdemo.replicators import build_replicator
from lightning_hetero.lowbit.packing import load_packed
from lightning_hetero.lowbit.sparse import decode_lists
from lightning_hetero.lowbit.wire import decode_flips, decode_sparse, encode_flips, encode_sparse
from lightning_hetero.matformer.aggregate import _check_reduced
from lightning_hetero.matformer.compressed import _bucket_names
from lightning_hetero.matformer.schema import SchemaMismatchError, agree_on_schema, canonical_hash
from lightning_hetero.subspace.codec import BoundaryCodec, pack_int8

REPO = Path(__file__).resolve().parents[1]
REFUSALS = (PeerPayloadError, SchemaMismatchError, ValueError, pickle.UnpicklingError)
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
    forged = codecs.pack_indices(torch.full((k,), 4000), 12)  # blocks of 32x32 = 1024 coefficients
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


# ------------------------------------------------------------------------------------------------ validity
def _valid(result: Any) -> bool:
    """Whether an accepted result is harmless: finite floats, indices within their space."""
    if isinstance(result, torch.Tensor):
        return not result.is_floating_point() or bool(torch.isfinite(result).all())
    if isinstance(result, (list, tuple)):
        return all(_valid(item) for item in result)
    return True


def catalogue(random_cases: int) -> list[tuple[str, str, Callable[[], Any], Callable[[Any], bool]]]:
    """``(decoder, bad input, run, is_valid)`` for every case."""
    sparse_body = 4 + codecs.index_nbytes(3, 12)
    index_ok = lambda out: all(int(i.max()) < NUMEL for i, _ in out if i.numel()) if isinstance(out, list) else True  # noqa: E731
    cases: list[tuple[str, str, Callable[[], Any], Callable[[Any], bool]]] = [
        ("flexdemo DeMo decode_gathered", "out-of-range coefficient index", _demo_gathered(_demo_index), _valid),
        ("flexdemo DeMo decode_gathered", "NaN value", _demo_gathered(_with_tail(NAN_F32)), _valid),
        ("flexdemo DeMo decode_gathered", "Inf value", _demo_gathered(_with_tail(INF_F32)), _valid),
        ("flexdemo DeMo decode_gathered", "truncated bytes", _demo_gathered(lambda w, p: w[:-3]), _valid),
        ("flexdemo random(sign) decode_gathered", "NaN scale", _dense_sign_scale, _valid),
        ("flexdemo random decode_reduced", "Inf in the all-reduced sum", _dense_reduced, _valid),
        ("comm.codecs unpack_indices", "truncated bytes", lambda: codecs.unpack_indices(_bytes([1, 2]), 4, 12), _valid),
        (
            "comm.codecs unpack_values",
            "wrong length",
            lambda: codecs.unpack_values(_bytes([0] * 7), 1, 2, "fp32"),
            _valid,
        ),
        ("lowbit decode_sparse", "NaN value", lambda: _decode(_sparse_with(sparse_body, NAN_F32)), _valid),
        ("lowbit decode_sparse", "Inf value", lambda: _decode(_sparse_with(sparse_body + 4, INF_F32)), _valid),
        (
            "lowbit decode_sparse",
            "out-of-range index",
            lambda: decode_sparse(
                encode_sparse(torch.tensor([3, 40, 150]), torch.ones(3), 4096, "fp32"), NUMEL, "fp32", peer=1
            ),
            _valid,
        ),
        (
            "lowbit decode_sparse",
            "indices not increasing",
            lambda: _decode(
                torch.cat((_sparse()[:4], codecs.pack_indices(torch.tensor([40, 3, 99]), 12), _sparse()[sparse_body:]))
            ),
            _valid,
        ),
        ("lowbit decode_sparse", "truncated bytes", lambda: _decode(_sparse()[:-1]), _valid),
        ("lowbit decode_sparse", "trailing bytes", lambda: _decode(torch.cat((_sparse(), _bytes([0])))), _valid),
        ("lowbit decode_sparse", "count above numel", lambda: _decode(_bytes([0xFF, 0xFF, 0, 0])), _valid),
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
            _valid,
        ),
        (
            "lowbit decode_flips",
            "out-of-range index",
            lambda: decode_flips(encode_flips(torch.tensor([150]), torch.ones(1), 4096), NUMEL, peer=0),
            _valid,
        ),
        (
            "lowbit decode_flips",
            "truncated bytes",
            lambda: decode_flips(encode_flips(torch.tensor([5, 9]), torch.ones(2), NUMEL)[:-1], NUMEL, peer=0),
            _valid,
        ),
        (
            "matformer setup agree_on_schema",
            "different schema",
            lambda: agree_on_schema([_schema_document(2), _schema_document(3)]),
            _valid,
        ),
        ("matformer setup agree_on_schema", "schema hash not matching its schema", _forged_hash, _valid),
        (
            "matformer aggregate (all-reduced bucket)",
            "NaN gradient",
            lambda: _check_reduced(torch.tensor([1.0, float("nan")]), (0, 1), "raise"),
            _valid,
        ),
        ("matformer checkpoint gather (bucket keys)", "not JSON", lambda: _keys("[1", 10), _valid),
        (
            "matformer checkpoint gather (bucket keys)",
            "keys not covering the values",
            lambda: _keys('["0,1|float32|6"]', 10),
            _valid,
        ),
        ("core all_gather_json", "not UTF-8", lambda: decode_json_payload(b"\xff\xfe", 1, JSON_SCHEMA), _valid),
        (
            "core all_gather_json",
            "NaN constant",
            lambda: decode_json_payload(b'{"error": NaN, "schema": null, "schema_hash": null}', 1, JSON_SCHEMA),
            _valid,
        ),
        ("core all_gather_json", "wrong keys", lambda: decode_json_payload(b'{"error": null}', 1, JSON_SCHEMA), _valid),
        (
            "core all_gather_json",
            "wrong value type",
            lambda: decode_json_payload(b'{"error": 3, "schema": null, "schema_hash": null}', 1, JSON_SCHEMA),
            _valid,
        ),
        ("core all_gather_json", "nesting bomb", lambda: decode_json_payload(b"[" * 100_000, 1, JSON_SCHEMA), _valid),
        (
            "subspace boundary codec",
            "NaN activation (fp32)",
            lambda: BoundaryCodec("fp32", 4).check_wire(torch.tensor([[[0.0, float("nan"), 1.0, 2.0]]]), peer=0),
            _valid,
        ),
        (
            "subspace boundary codec",
            "Inf gradient (bf16)",
            lambda: BoundaryCodec("bf16", 2).check_wire(
                torch.tensor([[[float("inf"), 1.0]]], dtype=torch.bfloat16), peer=2
            ),
            _valid,
        ),
        (
            "subspace boundary codec",
            "negative int8 scale",
            lambda: BoundaryCodec("int8", 4).check_wire(
                pack_int8(torch.ones(1, 1, 4)) * torch.tensor([1.0, -1.0]), peer=0
            ),
            _valid,
        ),
        (
            "subspace boundary codec",
            "overflowing int8 scale",
            lambda: BoundaryCodec("int8", 4).check_wire(
                torch.cat((pack_int8(torch.ones(1, 1, 4))[..., :1], torch.full((1, 1, 1), 3e38)), -1), peer=0
            ),
            _valid,
        ),
        (
            "subspace boundary codec",
            "wrong width",
            lambda: BoundaryCodec("fp32", 4).check_wire(torch.zeros(1, 1, 3), peer=0),
            _valid,
        ),
        ("core checkpoint part (torch.load weights_only=True)", "malicious pickle", _malicious_checkpoint, _valid),
        ("lowbit load_packed (safetensors)", "invalid 2-bit code", lambda: _packed_file(0xFF, [4]), _valid),
        ("lowbit load_packed (safetensors)", "shape not matching the bytes", lambda: _packed_file(0x00, [9]), _valid),
        ("lowbit load_packed (safetensors)", "not a safetensors file", lambda: _packed_file(None, [4]), _valid),
        ("testbed ledger dumps", "truncated JSON (killed rank)", lambda: _ledger_dump('{"rank": 0, "pi'), _valid),
        ("testbed ledger dumps", "wrong field types", lambda: _ledger_dump('{"rank": "0", "pid": []}'), _valid),
    ]
    for seed in range(random_cases):
        cases.append(
            (
                "flexdemo DeMo decode_gathered",
                f"random bytes (seed {seed})",
                _demo_gathered(lambda w, p, seed=seed: _random(seed, w.numel())),
                _valid,
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
                _valid,
            )
        )
    return cases


def _message(error: BaseException) -> str:
    """The error's class and message, without the random temporary folder names (so reruns give the same file)."""
    text = re.sub(re.escape(tempfile.gettempdir()) + r"/tmp\w+", "<tmpdir>", str(error))
    return f"{type(error).__name__}: {text[:200]}"


def run(random_cases: int) -> dict[str, Any]:
    """Every case's outcome and the totals."""
    records = []
    for decoder, bad_input, call, is_valid in catalogue(random_cases):
        record: dict[str, Any] = {"decoder": decoder, "input": bad_input}
        try:
            result = call()
            record["outcome"] = "accepted_valid" if is_valid(result) else "accepted_invalid"
        except REFUSALS as error:
            record["outcome"], record["error"] = "rejected", _message(error)
        except Exception as error:  # noqa: BLE001 - a crash is what the catalogue looks for
            record["outcome"], record["error"] = "crashed", _message(error)
        records.append(record)
    outcomes = [r["outcome"] for r in records]
    return {
        "command": f"python recipes/reliability_inputs.py --random-cases {random_cases}",
        "bad_inputs_tried": len(records),
        "bad_inputs_rejected": outcomes.count("rejected"),
        "random_bytes_accepted_as_valid_payloads": outcomes.count("accepted_valid"),
        "accepted_invalid": outcomes.count("accepted_invalid"),
        "crashed": outcomes.count("crashed"),
        "forged_inputs_rejected": sum(1 for r in records if "random" not in r["input"] and r["outcome"] == "rejected"),
        "forged_inputs_tried": sum(1 for r in records if "random" not in r["input"]),
        "cases": records,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-cases", type=int, default=25, help="random-bytes cases per decoder")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "reliability_inputs.json")
    args = parser.parse_args()
    result = run(args.random_cases)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k != "cases"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
