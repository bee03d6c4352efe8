"""The peer-payload rule on every sparseflip decoder, fuzzed: finite, bounded, in-range values or a PeerPayloadError.

Each decoder gets random bytes and structured inputs (a valid message with one field corrupted), and the combination
paths get lists that are finite alone but overflow fp32 when summed (2-4 lists of 3e38). Multi-rank averaging of such
lists: ``tests/dist/test_lowbit_exchange.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError
from lightning_hetero.sparseflip.fp_sync import SparseGradientAverage
from lightning_hetero.sparseflip.sparse import SparseFlipExchange, decode_lists, mean_of_lists, sum_lists
from lightning_hetero.sparseflip.wire import (
    HEADER_BYTES,
    decode_flips,
    decode_sparse,
    encode_flips,
    encode_sparse,
    index_section_nbytes,
)
from tests.payload_rule import assert_decoder_rule

FUZZ = settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
ENCODINGS = ["fp32", "bf16", "sign", "ternary"]
FIELDS = {"bytes", "count", "length", "index_table", "indices", "values", "scale", "padding", "directions"}
HUGE = 3e38  # finite in fp32 and bf16; two of them sum to Inf


def _list_layout(numel: int):
    def check(result: tuple[torch.Tensor, torch.Tensor]) -> None:
        indices, values = result
        assert indices.dtype == torch.int64 and values.dtype == torch.float32
        assert indices.dim() == values.dim() == 1 and indices.numel() == values.numel()
        if indices.numel():
            assert int(indices.min()) >= 0 and int(indices.max()) < numel
            assert bool((indices[1:] > indices[:-1]).all())

    return check


def _flip_layout(numel: int):
    def check(result: tuple[torch.Tensor, torch.Tensor]) -> None:
        indices, directions = result
        _list_layout(numel)((indices, directions.float()))
        assert bool((directions.abs() == 1).all())

    return check


def _refused(decode, peer: int) -> PeerPayloadError:
    with pytest.raises(PeerPayloadError) as caught:
        decode()
    assert caught.value.peer == peer and caught.value.field in FIELDS, (caught.value.peer, caught.value.field)
    assert f"rank {peer}" in str(caught.value)
    return caught.value


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "sign", "ternary"])
def test_a_finite_value_above_the_magnitude_bound_is_refused(encoding: str) -> None:
    message = encode_sparse(torch.tensor([1, 7]), torch.tensor([HUGE, -1.0]), 100, encoding)
    error = _refused(lambda: decode_sparse(message, 100, encoding, peer=2), 2)
    assert error.field in ("values", "scale") and "magnitude" in str(error)


def test_the_largest_bounded_value_is_accepted() -> None:
    message = encode_sparse(torch.tensor([1]), torch.tensor([MAX_PEER_MAGNITUDE]), 100, "fp32")
    assert decode_sparse(message, 100, "fp32", peer=0)[1].tolist() == [MAX_PEER_MAGNITUDE]


def test_fields_are_named() -> None:
    good = encode_sparse(torch.tensor([3, 40, 99]), torch.tensor([0.5, -1.0, 2.0]), 100, "fp32")
    assert _refused(lambda: decode_sparse(good[:-1], 100, "fp32", peer=1), 1).field == "length"
    assert _refused(lambda: decode_sparse(good.float(), 100, "fp32", peer=1), 1).field == "bytes"
    huge_count = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)
    assert _refused(lambda: decode_sparse(huge_count, 100, "fp32", peer=1), 1).field == "count"
    nan = good.clone()
    nan[-4:] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)
    assert _refused(lambda: decode_sparse(nan, 100, "fp32", peer=1), 1).field == "values"
    backwards = encode_sparse(torch.tensor([3, 40]), torch.ones(2), 100, "fp32")
    backwards[HEADER_BYTES : HEADER_BYTES + 3] = torch.tensor([40, 0x30, 0x00], dtype=torch.uint8)  # 40, then 3
    assert _refused(lambda: decode_sparse(backwards, 100, "fp32", peer=1), 1).field == "indices"
    assert _refused(lambda: decode_flips(torch.tensor([9, 0, 0, 0], dtype=torch.uint8), 100, peer=0), 0).field in (
        "length",
        "count",
    )


@FUZZ
@given(
    raw=st.binary(max_size=80),
    numel=st.sampled_from([1, 100, 5000, 70000, 200_000]),
    encoding=st.sampled_from(ENCODINGS),
)
def test_random_bytes_keep_the_rule(raw: bytes, numel: int, encoding: str) -> None:
    data = torch.tensor(list(raw), dtype=torch.uint8)
    assert_decoder_rule(lambda: decode_sparse(data, numel, encoding, peer=3), peer=3, check_layout=_list_layout(numel))
    assert_decoder_rule(lambda: decode_flips(data, numel, peer=3), peer=3, check_layout=_flip_layout(numel))


def _float_bits(value: float) -> list[int]:
    return torch.tensor([value], dtype=torch.float32).view(torch.uint8).tolist()


def _bf16_bits(value: float) -> list[int]:
    return torch.tensor([value], dtype=torch.float32).to(torch.bfloat16).view(torch.uint8).tolist()


@FUZZ
@given(
    seed=st.integers(0, 10**6),
    count=st.integers(1, 30),
    encoding=st.sampled_from(ENCODINGS),
    numel=st.sampled_from([100, 5000, 200_000]),
    field=st.sampled_from(["count", "index", "value", "byte"]),
    number=st.floats(width=32) | st.sampled_from([HUGE, -HUGE, 2.0**64, 2.0**65, float("inf")]),
    byte=st.integers(0, 255),
)
def test_a_valid_list_with_one_field_corrupted_keeps_the_rule(
    seed: int, count: int, encoding: str, numel: int, field: str, number: float, byte: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    count = min(count, numel)
    indices = torch.randperm(numel, generator=gen)[:count].sort().values
    message = encode_sparse(indices, torch.randn(count, generator=gen), numel, encoding)
    values_at = HEADER_BYTES + index_section_nbytes(count, numel)
    position = int(torch.randint(0, message.numel(), (1,), generator=gen))
    if field == "count":
        message[:HEADER_BYTES] = torch.tensor(_float_bits(number), dtype=torch.uint8)
    elif field == "index":
        message[HEADER_BYTES + position % (values_at - HEADER_BYTES)] = byte
    elif field == "value":  # a float where a value (fp32), two bf16 values or a sign/ternary scale lies
        start = message.numel() - 4 if encoding in ("sign", "ternary") else values_at
        bits = _float_bits(number) if encoding != "bf16" else _bf16_bits(number)
        message[start : start + len(bits)] = torch.tensor(bits, dtype=torch.uint8)
    else:
        message[position] = byte
    assert_decoder_rule(
        lambda: decode_sparse(message, numel, encoding, peer=1), peer=1, check_layout=_list_layout(numel)
    )
    flips = encode_flips(indices, torch.where(torch.randn(count, generator=gen) < 0, -1, 1), numel)
    flips[position % flips.numel()] = byte
    assert_decoder_rule(lambda: decode_flips(flips, numel, peer=0), peer=0, check_layout=_flip_layout(numel))


@FUZZ
@given(
    lists=st.integers(2, 4),
    magnitude=st.sampled_from([HUGE, 1.7e38, 2.0**64, 2.0**63]) | st.floats(1e18, 3.4e38),
    encoding=st.sampled_from(["fp32", "bf16"]),
    policy=st.sampled_from(["raise", "drop"]),
    overlap=st.booleans(),
)
def test_lists_finite_alone_that_overflow_when_combined_keep_the_rule(
    lists: int, magnitude: float, encoding: str, policy: str, overlap: bool
) -> None:
    messages = [
        encode_sparse(torch.tensor([5 if overlap else 5 + r, 50]), torch.tensor([magnitude, -magnitude]), 100, encoding)
        for r in range(lists)
    ]

    def combine() -> dict[str, torch.Tensor]:
        decoded = decode_lists(messages, 100, encoding, policy)
        return {"sum": sum_lists(decoded, 100), "mean": mean_of_lists(decoded, 100, lists)}

    for result in (combine, lambda: decode_lists(messages, 100, encoding, policy)):
        out = assert_decoder_rule(result, bound=MAX_PEER_MAGNITUDE * lists)
        if isinstance(out, dict):
            assert float(out["mean"].abs().max()) <= MAX_PEER_MAGNITUDE


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_the_fp_average_never_returns_a_value_above_the_bound(policy: str) -> None:
    grad = torch.zeros(100)
    grad[7] = HUGE
    average = SparseGradientAverage(100, 0.1, "fp32", on_bad_payload=policy)
    result = assert_decoder_rule(lambda: average.average(grad), peer=0)
    if policy == "drop":
        assert result is not None and torch.equal(result, torch.zeros(100)) and average.dropped_payloads == 1
    else:
        assert result is None


@pytest.mark.parametrize("mode", ["server", "allgather"])
def test_the_flip_exchange_refuses_a_list_above_the_bound(mode: str) -> None:
    grad = torch.zeros(100)
    grad[7] = HUGE
    exchange = SparseFlipExchange(100, 4, density=0.1, encoding="fp32", mode=mode)
    with pytest.raises(PeerPayloadError, match="magnitude"):
        exchange.step(grad, torch.zeros(100, dtype=torch.int8))
