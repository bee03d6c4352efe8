"""Corrupt sparse lists from a peer: refused naming the rank, or dropped (empty list, counted) under "drop".

The wire decoders' own validation is fuzzed in ``test_wire.py``; this file covers the error type, the peer's name
and the drop policy of the exchange paths (multi-rank behaviour: ``tests/dist/test_peer_payloads.py``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.sparseflip.fp_sync import SparseGradientAverage
from lightning_hetero.sparseflip.settings import SparseFlipSettings
from lightning_hetero.sparseflip.sparse import SparseFlipExchange, all_gather_messages, decode_lists
from lightning_hetero.sparseflip.wire import HEADER_BYTES, decode_flips, decode_sparse, encode_sparse

FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
NUMEL = 100


def _good() -> torch.Tensor:
    return encode_sparse(torch.tensor([3, 40, 99]), torch.tensor([0.5, -1.0, 2.0]), NUMEL, "fp32")


def _with_nan() -> torch.Tensor:
    message = _good()
    message[-4:] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)
    return message


def _out_of_range() -> torch.Tensor:
    """Index 150 in a list over 100 codes (both spaces use 12-bit indices, so the layout is the same)."""
    return encode_sparse(torch.tensor([3, 40, 150]), torch.ones(3), 4096, "fp32")


@pytest.mark.parametrize(
    ("forge", "match"),
    [
        (_with_nan, "NaN or Inf"),
        (_out_of_range, "index out of range"),
        (lambda: _good()[:-1], "bytes, expected"),
        (lambda: torch.cat((_good(), torch.zeros(1, dtype=torch.uint8))), "bytes, expected"),
        (lambda: torch.tensor([0xFF, 0xFF, 0xFF, 0xFF], dtype=torch.uint8), "exceeds numel"),
        (lambda: _good().float(), "must be a uint8 tensor"),
    ],
)
def test_a_corrupt_list_is_a_peer_payload_error_naming_the_rank(forge, match):
    with pytest.raises(PeerPayloadError, match=f"sparse message from rank 3 refused: .*{match}") as caught:
        decode_sparse(forge(), NUMEL, "fp32", peer=3)
    assert caught.value.peer == 3


def test_a_corrupt_flip_set_names_the_server():
    with pytest.raises(PeerPayloadError, match="flip message from rank 0 refused"):
        decode_flips(torch.tensor([9, 0, 0, 0], dtype=torch.uint8), NUMEL, peer=0)


def test_decode_lists_raises_or_drops_and_counts(caplog):
    messages = [_good(), _with_nan(), _good()]
    with pytest.raises(PeerPayloadError, match="from rank 1"):
        decode_lists(messages, NUMEL, "fp32")
    counter = SparseFlipExchange(NUMEL, 4, density=0.1, encoding="fp32", on_bad_payload="drop")
    with caplog.at_level(logging.WARNING, logger="lightning_hetero.peer_payloads"):
        lists = decode_lists(messages, NUMEL, "fp32", "drop", counter)
    assert counter.dropped_payloads == 1 and "rank 1's sparse list left out" in caplog.text
    assert [indices.tolist() for indices, _ in lists] == [[3, 40, 99], [], [3, 40, 99]]


@FUZZ
@given(st.binary(max_size=48), st.sampled_from(["fp32", "bf16", "sign", "ternary"]))
def test_random_bytes_from_a_peer_never_crash_and_drop_to_an_empty_list(data, encoding):
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    try:
        ((indices, values),) = decode_lists([raw], NUMEL, encoding)
    except PeerPayloadError:
        ((indices, values),) = decode_lists([raw], NUMEL, encoding, "drop")
        assert indices.numel() == values.numel() == 0
        return
    assert indices.numel() == values.numel() and bool(torch.isfinite(values).all())
    assert indices.numel() == 0 or (int(indices.min()) >= 0 and int(indices.max()) < NUMEL)


def test_an_oversized_header_is_refused_or_sized_empty_under_drop():
    forged = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)  # count 2**31 - 1 > numel
    with pytest.raises(PeerPayloadError, match="header from rank 0: count 2147483647 exceeds numel 100"):
        all_gather_messages(forged, 1, NUMEL, "fp32", label="inter")
    (kept,) = all_gather_messages(forged, 1, NUMEL, "fp32", "drop", label="inter")
    assert kept.numel() == HEADER_BYTES  # then refused (and dropped) by decode_lists


def test_the_fp_average_of_a_single_rank_is_unchanged_by_the_policy():
    grad = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    results = [SparseGradientAverage(NUMEL, 0.2, "fp32", on_bad_payload=p).average(grad) for p in ("raise", "drop")]
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("build", [SparseGradientAverage, SparseFlipExchange, SparseFlipSettings])
def test_a_bad_policy_is_refused_at_construction(build):
    arguments = {
        SparseGradientAverage: {"numel": NUMEL, "density": 0.1},
        SparseFlipExchange: {"numel": NUMEL, "k": 4, "density": 0.1},
        SparseFlipSettings: {},
    }[build]
    with pytest.raises(ValueError, match="on_bad_payload='skip'.*'raise'.*'drop'"):
        build(**arguments, on_bad_payload="skip")


def test_a_file_that_is_not_safetensors_is_refused_naming_it(tmp_path):
    from lightning_hetero.sparseflip.packing import load_packed

    path = tmp_path / "packed.safetensors"
    path.write_bytes(b"\x80" * 64)
    with pytest.raises(ValueError, match="packed.safetensors is not a readable safetensors file"):
        load_packed(path)
