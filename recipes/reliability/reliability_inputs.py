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

    python recipes/reliability/reliability_inputs.py [--random-cases 25] [--out docs/results/reliability_inputs.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pickle
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_hetero.comm import payload_packing
from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError
from lightning_hetero.core.state import decode_json_payload
from lightning_hetero.matformer.aggregate import _check_reduced
from lightning_hetero.matformer.compressed import decode_error_feedback
from lightning_hetero.matformer.schema import SchemaMismatchError, agree_on_schema
from lightning_hetero.pipeline.boundary_codec import BoundaryCodec, pack_int8
from lightning_hetero.pipeline.stage_gather import decode_stage_state
from lightning_hetero.sparseflip.sparse import decode_lists
from lightning_hetero.sparseflip.wire import decode_flips, decode_sparse, encode_flips, encode_sparse

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its parts, also when loaded by path (the tests)

from input_forgeries import (  # noqa: E402
    INF_F32,
    JSON_SCHEMA,
    NAN_F32,
    NUMEL,
    CodeRan,
    Refused,
    bad_manifest,
    bucket_keys,
    byte_tensor,
    decode_sparse_message,
    demo_gathered,
    demo_index,
    demo_wire,
    dense_reduced,
    dense_sign_scale,
    duplicate_indices,
    flipped_bit_checkpoint,
    forged_hash,
    huge_column,
    int8_minus_128,
    layerwise_header,
    ledger_dump,
    malicious_checkpoint,
    manifests_gone,
    packed_file,
    pickle_through_strategy,
    random_bytes,
    schema_document,
    sparse_message,
    sparse_message_with,
    ternary_code_3,
    two_huge_lists,
    with_tail,
)
from input_gathers import EF_KEY, GATHER_CASES, gather_case  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
REFUSALS = (PeerPayloadError, SchemaMismatchError, ValueError, pickle.UnpicklingError)


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
    return _valid(out) and all(key == EF_KEY and value.numel() == 8 for key, value in out.items())


def catalogue(random_cases: int) -> list[tuple[str, str, Callable[[], Any], Callable[[Any], bool]]]:
    """``(decoder, bad input, run, is_valid)`` for every case."""
    sparse_body = 4 + payload_packing.index_nbytes(3, 12)
    index_ok = lambda out: all(int(i.max()) < NUMEL for i, _ in out if i.numel()) if isinstance(out, list) else True  # noqa: E731
    cases: list[tuple[str, str, Callable[[], Any], Callable[[Any], bool]]] = [
        ("flexdemo DeMo decode_gathered", "out-of-range coefficient index", demo_gathered(demo_index), _forged),
        ("flexdemo DeMo decode_gathered", "NaN value", demo_gathered(with_tail(NAN_F32)), _forged),
        ("flexdemo DeMo decode_gathered", "Inf value", demo_gathered(with_tail(INF_F32)), _forged),
        ("flexdemo DeMo decode_gathered", "truncated bytes", demo_gathered(lambda w, p: w[:-3]), _forged),
        ("flexdemo random(sign) decode_gathered", "NaN scale", dense_sign_scale, _forged),
        ("flexdemo random decode_reduced", "Inf in the all-reduced sum", dense_reduced, _forged),
        (
            "comm.payload_packing unpack_indices",
            "truncated bytes",
            lambda: payload_packing.unpack_indices(byte_tensor([1, 2]), 4, 12),
            _forged,
        ),
        (
            "comm.payload_packing unpack_values",
            "wrong length",
            lambda: payload_packing.unpack_values(byte_tensor([0] * 7), 1, 2, "fp32"),
            _forged,
        ),
        (
            "lowbit decode_sparse",
            "NaN value",
            lambda: decode_sparse_message(sparse_message_with(sparse_body, NAN_F32)),
            _forged,
        ),
        (
            "lowbit decode_sparse",
            "Inf value",
            lambda: decode_sparse_message(sparse_message_with(sparse_body + 4, INF_F32)),
            _forged,
        ),
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
            lambda: decode_sparse_message(
                torch.cat(
                    (
                        sparse_message()[:4],
                        payload_packing.pack_indices(torch.tensor([40, 3, 99]), 12),
                        sparse_message()[sparse_body:],
                    )
                )
            ),
            _forged,
        ),
        ("lowbit decode_sparse", "truncated bytes", lambda: decode_sparse_message(sparse_message()[:-1]), _forged),
        (
            "lowbit decode_sparse",
            "trailing bytes",
            lambda: decode_sparse_message(torch.cat((sparse_message(), byte_tensor([0])))),
            _forged,
        ),
        (
            "lowbit decode_sparse",
            "count above numel",
            lambda: decode_sparse_message(byte_tensor([0xFF, 0xFF, 0, 0])),
            _forged,
        ),
        (
            "lowbit decode_sparse",
            "negative sign scale",
            lambda: decode_sparse_message(
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
            lambda: agree_on_schema([schema_document(2), schema_document(3)]),
            _forged,
        ),
        ("matformer setup agree_on_schema", "schema hash not matching its schema", forged_hash, _forged),
        (
            "matformer aggregate (all-reduced bucket)",
            "NaN gradient",
            lambda: _check_reduced(torch.tensor([1.0, float("nan")]), (0, 1), "raise"),
            _forged,
        ),
        ("matformer checkpoint gather (bucket keys)", "not JSON", lambda: bucket_keys("[1", 10), _forged),
        (
            "matformer checkpoint gather (bucket keys)",
            "keys not covering the values",
            lambda: bucket_keys('["0,1|float32|6"]', 10),
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
        ("core checkpoint part (torch.load weights_only=True)", "malicious pickle", malicious_checkpoint, _forged),
        ("lowbit load_packed (safetensors)", "invalid 2-bit code", lambda: packed_file(0xFF, [4]), _forged),
        ("lowbit load_packed (safetensors)", "shape not matching the bytes", lambda: packed_file(0x00, [9]), _forged),
        ("lowbit load_packed (safetensors)", "not a safetensors file", lambda: packed_file(None, [4]), _forged),
        ("testbed ledger dumps", "truncated JSON (killed rank)", lambda: ledger_dump('{"rank": 0, "pi'), _forged),
        ("testbed ledger dumps", "wrong field types", lambda: ledger_dump('{"rank": "0", "pid": []}'), _forged),
        # Issue 21: the attacks found by trying the system as an attacker would.
        *(
            (
                f"{kind} load_checkpoint (single file)",
                f"malicious pickle, {how}",
                pickle_through_strategy(*args),
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
            demo_wire("fp32", huge_column),
            _forged,
        ),
        (
            "flexdemo DeMo decode_gathered (2 replicas)",
            "ternary code 3",
            demo_wire("ternary", ternary_code_3),
            _forged,
        ),
        (
            "flexdemo DeMo decode_gathered (2 replicas)",
            "negative sign scale",
            demo_wire("sign", with_tail(list(torch.tensor([-1.0]).view(torch.uint8).tolist()))),
            _forged,
        ),
        (
            "flexdemo DeMo decode_gathered (2 replicas)",
            "negative ternary scale",
            demo_wire("ternary", with_tail(list(torch.tensor([-1.0]).view(torch.uint8).tolist()))),
            _forged,
        ),
        (
            "flexdemo DeMo decode_gathered (2 replicas)",
            "duplicate indices",
            demo_wire("fp32", duplicate_indices),
            _forged,
        ),
        ("lowbit fp lists mean_of_lists", "two finite 3e38 fp lists combined", two_huge_lists, _forged),
        (
            "subspace boundary codec",
            "int8 byte -128 with a scale just under float32 max / 127",
            int8_minus_128,
            _forged,
        ),
        ("layerwise async header (check_header)", "4 GiB announced for one message", layerwise_header, _forged),
        *((decoder, kind, gather_case(kind), _forged) for decoder, kinds in GATHER_CASES.items() for kind in kinds),
        (
            "reliability latest_good_checkpoint",
            "newer manifest without step",
            bad_manifest(lambda m: m.pop("step")),
            _forged,
        ),
        (
            "reliability latest_good_checkpoint",
            "newer manifest with a non-integer step",
            bad_manifest(lambda m: m.update(step="2")),
            _forged,
        ),
        (
            "reliability latest_good_checkpoint",
            "newer manifest of another version",
            bad_manifest(lambda m: m.update(version=99)),
            _forged,
        ),
        ("reliability latest_good_checkpoint", "every manifest gone", manifests_gone, _forged),
        ("matformer load_checkpoint (ckpt_path)", "one flipped bit, with a manifest", flipped_bit_checkpoint, _forged),
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
        ("lowbit load_packed (safetensors)", "negative shape", lambda: packed_file(0x00, [-4]), _forged),
    ]
    # Issue 33: recovery blobs of the fault-tolerant path (recipes/reliability/ft_inputs.py).
    spec = importlib.util.spec_from_file_location("ft_inputs", REPO / "recipes" / "reliability" / "ft_inputs.py")
    ft_cases = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(ft_cases)  # type: ignore[union-attr]
    cases.extend(ft_cases.recovery_cases(random_cases))
    for seed in range(random_cases):
        cases.append(
            (
                "flexdemo DeMo decode_gathered",
                f"random bytes (seed {seed})",
                demo_gathered(lambda w, p, seed=seed: random_bytes(seed, w.numel())),
                _shaped((32, 32)),
            )
        )
        cases.append(
            (
                "lowbit decode_lists",
                f"random bytes (seed {seed})",
                lambda seed=seed: decode_lists([random_bytes(seed, 4 + seed)], NUMEL, "bf16"),
                lambda out: _valid(out) and index_ok(out),
            )
        )
        cases.append(
            (
                "core all_gather_json",
                f"random bytes (seed {seed})",
                lambda seed=seed: decode_json_payload(bytes(random_bytes(seed, 24).tolist()), 1, JSON_SCHEMA),
                _valid,
            )
        )
        cases.append(
            (
                "subspace boundary codec (int8)",
                f"random bytes (seed {seed})",
                lambda seed=seed: (
                    BoundaryCodec("int8", 8).check_wire(
                        w := random_bytes(seed, 48).view(torch.float32).reshape(1, 4, 3), peer=1
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
                lambda seed=seed: decode_stage_state(bytes(random_bytes(seed, 16 + 8 * seed).tolist()), peer=1),
                _valid,
            )
        )
        cases.append(
            (
                "matformer decode_error_feedback",
                f"random bytes (seed {seed})",
                lambda seed=seed: decode_error_feedback(
                    random_bytes(seed, 18),
                    random_bytes(seed + 1000, 32).view(torch.float32),
                    source=1,
                    allowed={EF_KEY},
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
        "command": f"python recipes/reliability/reliability_inputs.py --random-cases {random_cases}",
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
    args = parser.parse_args()
    result = run(args.random_cases)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k != "cases"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
