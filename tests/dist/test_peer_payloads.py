"""A hostile rank on 2 spawned gloo ranks: every peer-bytes path refuses its payload on every rank, or drops it.

One launch runs every scenario in sequence on the same process group (each leaves the ranks in step, which the next
scenario relies on): the sparse flip exchange in server and all-gather mode, the sparse fp average, the JSON setup
agreement, and a FlexDeMo DeMo bucket. Rank 1 is the hostile one: it corrupts the bytes it sends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lightning_hetero.sparseflip.fp_sync as fp_sync_module
import lightning_hetero.sparseflip.sparse as sparse_module
from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.core import all_gather_json
from lightning_hetero.replication import build_replicator
from lightning_hetero.sparseflip.fp_sync import SparseGradientAverage
from lightning_hetero.sparseflip.sparse import SparseFlipExchange
from lightning_hetero.sparseflip.wire import HEADER_BYTES, encode_sparse, index_section_nbytes
from lightning_hetero.testing import run_distributed

pytestmark = pytest.mark.timeout(240)

NUMEL = 64
HOSTILE = 1


def _nan_encoder(indices: torch.Tensor, values: torch.Tensor, numel: int, encoding: str = "bf16") -> torch.Tensor:
    """``encode_sparse`` of a hostile rank: the first fp32 value of the list becomes NaN."""
    message = encode_sparse(indices, values, numel, encoding)
    start = HEADER_BYTES + index_section_nbytes(indices.numel(), numel)
    message[start : start + 4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # fp32 NaN, little-endian
    return message


def _grad(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 + rank))


def _caught(fn: Any) -> str:
    try:
        fn()
    except PeerPayloadError as error:
        return f"PeerPayloadError: {error}"
    return "accepted"


def _flip_scenarios(rank: int, out: dict[str, Any]) -> None:
    codes = torch.zeros(NUMEL, dtype=torch.int8)
    honest = sparse_module.encode_sparse
    if rank == HOSTILE:
        sparse_module.encode_sparse = fp_sync_module.encode_sparse = _nan_encoder
    try:
        for mode in ("server", "allgather"):
            exchange = SparseFlipExchange(NUMEL, 8, density=0.25, encoding="fp32", mode=mode)
            out[f"{mode}_raise"] = _caught(lambda exchange=exchange: exchange.step(_grad(rank), codes))
        dropping = SparseFlipExchange(NUMEL, 8, density=0.25, encoding="fp32", mode="allgather", on_bad_payload="drop")
        flips = dropping.step(_grad(rank), codes)
        out["allgather_drop"] = [t.tolist() for t in flips]
        out["allgather_dropped"] = dropping.dropped_payloads
        server_drop = SparseFlipExchange(NUMEL, 8, density=0.25, encoding="fp32", on_bad_payload="drop")
        out["server_drop"] = [t.tolist() for t in server_drop.step(_grad(rank), codes)]
        average = SparseGradientAverage(NUMEL, 0.25, "fp32", on_bad_payload="drop")
        out["fp_average"] = average.average(_grad(rank)).tolist()
        out["fp_dropped"] = average.dropped_payloads
    finally:
        sparse_module.encode_sparse = fp_sync_module.encode_sparse = honest
    # What the honest rank alone would send: the reference for the dropped steps.
    alone = SparseFlipExchange(NUMEL, 8, density=0.25, encoding="fp32", mode="allgather")
    out["honest_alone"] = [t.tolist() for t in alone._decide([_select(0)], codes, 1)]
    indices, values = _select(0)
    out["honest_average"] = torch.zeros(NUMEL).index_add_(0, indices, values).tolist()


def _select(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_module.select_sparse(_grad(rank), density=0.25)


def _json_scenarios(rank: int, world: int, out: dict[str, Any]) -> None:
    schema = {"error": (str, type(None)), "step": int}
    good = {"error": None, "step": 3}
    hostile = {"error": None, "steps": "3"} if rank == HOSTILE else good
    out["json_schema"] = _caught(lambda: all_gather_json(hostile, world, torch.device("cpu"), schema=schema))
    big = {"error": "x" * 4096, "step": 3} if rank == HOSTILE else good
    out["json_size"] = _caught(lambda: all_gather_json(big, world, torch.device("cpu"), max_bytes=1024, schema=schema))
    out["json_ok"] = all_gather_json(good, world, torch.device("cpu"), schema=schema)


def _flexdemo_scenarios(rank: int, out: dict[str, Any]) -> None:
    import torch.distributed as dist

    for policy in ("raise", "drop"):
        replicator = build_replicator("demo", 1 / 32, chunk=32, values="fp32", index_bits=12)
        replicator.set_bad_payload_policy(policy)
        replicator.setup(dist.group.WORLD)
        source = torch.randn(32, 32, generator=torch.Generator().manual_seed(rank))
        piece = replicator.encode(0, source)
        if rank == HOSTILE:
            piece.wire[-4:] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # last fp32 value: NaN
        bucket = replicator.launch([piece])
        if policy == "raise":
            out["flexdemo_raise"] = _caught(lambda bucket=bucket, replicator=replicator: replicator.finish(bucket))
        else:
            (combined,) = replicator.finish(bucket)
            out["flexdemo_drop"] = combined.tolist()
            out["flexdemo_dropped"] = replicator.dropped_payloads
            out["flexdemo_rank0_alone"] = None
            if rank == 0:
                alone = build_replicator("demo", 1 / 32, chunk=32, values="fp32", index_bits=12)
                own = alone.encode(0, torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))
                out["flexdemo_rank0_alone"] = alone.decode_gathered(own, [own.wire]).tolist()


def _worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _flip_scenarios(rank, out)
    _json_scenarios(rank, world, out)
    _flexdemo_scenarios(rank, out)
    return out


def test_a_hostile_rank_is_refused_on_every_rank_or_dropped_identically():
    honest, hostile = run_distributed(_worker, 2, timeout=200)
    for out in (honest, hostile):
        # raise: every rank stops with the error (the server tells its workers), nobody hangs or applies NaN.
        assert out["allgather_raise"].startswith("PeerPayloadError: sparse message from rank 1 refused")
        assert out["json_schema"].startswith("PeerPayloadError: rank 1 sent a setup document with keys")
        assert out["json_size"].startswith("PeerPayloadError: rank 1 announced a")
        assert out["json_ok"] == [{"error": None, "step": 3}] * 2
        assert out["flexdemo_raise"].startswith("PeerPayloadError: replica 1 sent non-finite values")
        assert out["allgather_dropped"] == 1 and out["fp_dropped"] == 1 and out["flexdemo_dropped"] == 1
    assert "sparse message from rank 1 refused" in honest["server_raise"]  # the server saw which rank
    assert "the flip server (rank 0) refused" in hostile["server_raise"]
    # drop: the hostile list is left out identically everywhere: the result is the honest rank's alone.
    assert honest["allgather_drop"] == hostile["allgather_drop"] == honest["honest_alone"]
    assert honest["server_drop"] == hostile["server_drop"] == honest["honest_alone"]
    assert honest["fp_average"] == hostile["fp_average"] == honest["honest_average"]
    assert honest["flexdemo_drop"] == hostile["flexdemo_drop"] == honest["flexdemo_rank0_alone"]


def _oversized_header(indices: torch.Tensor, values: torch.Tensor, numel: int, encoding: str = "bf16") -> torch.Tensor:
    """A hostile header alone: it announces 2**32 - 2 entries (its body could never be sized)."""
    return torch.tensor([0xFE, 0xFF, 0xFF, 0xFF], dtype=torch.uint8)


def _unsized_worker(rank: int, world: int) -> dict[str, Any]:
    codes = torch.zeros(NUMEL, dtype=torch.int8)
    if rank == HOSTILE:
        sparse_module.encode_sparse = _oversized_header
    exchange = SparseFlipExchange(NUMEL, 8, density=0.25, encoding="fp32", on_bad_payload="drop")
    refused = _caught(lambda: exchange.step(_grad(rank), codes))
    sparse_module.encode_sparse = encode_sparse
    after = SparseFlipExchange(NUMEL, 8, density=0.25, encoding="fp32").step(_grad(rank), codes)  # still in step
    return {"refused": refused, "after": [t.tolist() for t in after]}


def test_an_unsizable_header_in_server_mode_stops_every_rank_and_no_honest_worker_hangs():
    results = run_distributed(_unsized_worker, 3, timeout=200)
    assert "header from rank 1: count 4294967294 exceeds numel" in results[0]["refused"]  # even under "drop"
    assert all("the flip server (rank 0) refused" in out["refused"] for out in results[1:])
    assert results[0]["after"] == results[1]["after"] == results[2]["after"]
