"""parse_bandwidth follows tc: ``bit`` forms are bits/s, ``bps`` forms are BYTES/s."""

from __future__ import annotations

import pytest

from lightning_hetero.comm.units import format_bytes, parse_bandwidth, transfer_seconds


@pytest.mark.parametrize(
    ("rate", "bits_per_second"),
    [
        ("1bit", 1.0),
        ("1kbit", 1e3),
        ("100mbit", 1e8),
        ("1gbit", 1e9),
        ("2tbit", 2e12),
        ("1bps", 8.0),
        ("1kbps", 8e3),
        ("1mbps", 8e6),  # the tc trap: mbps is megaBYTES per second
        ("1gbps", 8e9),
        ("1.5gbit", 1.5e9),
        (".5mbit", 5e5),
        ("2e3kbit", 2e6),
        ("1GBit", 1e9),
        ("10MBPS", 8e7),
        ("  250 mbit ", 2.5e8),
        ("1mibit", 1048576.0),
        ("1kibps", 8192.0),
        ("12345", 12345.0),
        (1e9, 1e9),
        (100, 100.0),
    ],
)
def test_parse_bandwidth_units(rate: str | float, bits_per_second: float) -> None:
    assert parse_bandwidth(rate) == bits_per_second


@pytest.mark.parametrize(
    ("rate", "why"),
    [
        ("", "expected '<positive number><unit>'"),
        ("   ", "expected '<positive number><unit>'"),
        ("-1mbit", "expected '<positive number><unit>'"),
        ("0mbit", "positive and finite"),
        ("0", "positive and finite"),
        ("10furlongs", "unknown unit 'furlongs'"),
        ("mbit", "expected '<positive number><unit>'"),
        ("1 m bit", "expected '<positive number><unit>'"),
        (0, "positive and finite"),
        (-5.0, "positive and finite"),
        (float("inf"), "positive and finite"),
        (float("nan"), "positive and finite"),
        (True, "boolean"),
        (None, "expected a string or a number"),
    ],
)
def test_parse_bandwidth_rejects_bad_values_with_a_helpful_message(rate: object, why: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_bandwidth(rate)  # type: ignore[arg-type]
    message = str(error.value)
    assert repr(rate) in message
    assert why in message
    assert "mbit" in message and "mbps" in message and "BYTES/s" in message
    assert "Example: '100mbit'" in message


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (1048576, "1.00 MiB"),
        (3 * 2**30, "3.00 GiB"),
        (2**40, "1.00 TiB"),
        (2**60, "1024.00 PiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text


def test_transfer_seconds() -> None:
    assert transfer_seconds(125_000_000, "1gbit") == 1.0
    assert transfer_seconds(1_000_000, "1mbps") == 1.0  # 1 MB at 1 MB/s
    assert transfer_seconds(0, "100mbit") == 0.0
    with pytest.raises(ValueError, match="num_bytes"):
        transfer_seconds(-1, "1gbit")
    with pytest.raises(ValueError, match="'1 gigabit'"):
        transfer_seconds(1, "1 gigabit")
