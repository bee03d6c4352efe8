"""Bulk TCP sender and receiver for the selftest; the receiver measures goodput and wire rate over the same window.

    python -m lightning_hetero.testbed.throughput receive --port 5201 [--warmup 0.5] [--interface eth0]
    python -m lightning_hetero.testbed.throughput send --host 10.213.0.2 --port 5201 --seconds 3

The receiver skips ``--warmup`` seconds after the first byte (the token bucket's initial burst and TCP slow start),
then measures until the sender closes: payload bytes read (goodput) and the growth of its interface's ``rx_bytes``
counter (``/sys/class/net/<if>/statistics``, which ``ip netns exec`` mounts for the namespace). It prints one JSON
line. Standard library only, so it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

_CHUNK = 1 << 16


def _rx_bytes(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/rx_bytes").read_text())


def receive(port: int, warmup: float, interface: str, accept_timeout: float) -> dict[str, float]:
    """Accept one connection, read until EOF, return the measured window."""
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(accept_timeout)
        connection, _ = server.accept()
    with connection:
        connection.settimeout(accept_timeout)
        first = connection.recv(_CHUNK)
        first_byte_at = time.monotonic()
        payload = len(first)
        window_start: tuple[float, int, int] | None = None
        while True:
            data = connection.recv(_CHUNK)
            now = time.monotonic()
            if not data:
                break
            payload += len(data)
            if window_start is None and now - first_byte_at >= warmup:
                window_start = (now, payload, _rx_bytes(interface))
        end = (now, payload, _rx_bytes(interface))
    if window_start is None:
        raise RuntimeError(f"the transfer ended within the {warmup} s warm-up; send for longer")
    seconds = end[0] - window_start[0]
    return {
        "seconds": seconds,
        "payload_bytes": end[1] - window_start[1],
        "wire_rx_bytes": end[2] - window_start[2],
        "goodput_bits_per_second": (end[1] - window_start[1]) * 8 / seconds,
        "wire_bits_per_second": (end[2] - window_start[2]) * 8 / seconds,
        "total_payload_bytes": payload,
    }


def send(host: str, port: int, seconds: float, connect_timeout: float) -> int:
    """Connect (retrying while the receiver starts) and send for ``seconds``; returns the bytes sent."""
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            connection = socket.create_connection((host, port), timeout=connect_timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    buffer, sent = b"\0" * _CHUNK, 0
    with connection:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            connection.sendall(buffer)
            sent += len(buffer)
    return sent


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m lightning_hetero.testbed.throughput")
    modes = parser.add_subparsers(dest="mode", required=True)
    receiver = modes.add_parser("receive", help="accept one connection and measure")
    receiver.add_argument("--port", type=int, required=True)
    receiver.add_argument("--warmup", type=float, default=0.5, help="seconds after the first byte not measured")
    receiver.add_argument("--interface", default="eth0", help="interface whose rx_bytes give the wire rate")
    receiver.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for the sender or for data")
    sender = modes.add_parser("send", help="send zeros for a while")
    sender.add_argument("--host", required=True)
    sender.add_argument("--port", type=int, required=True)
    sender.add_argument("--seconds", type=float, default=3.0)
    sender.add_argument("--timeout", type=float, default=10.0, help="seconds to keep retrying the connection")
    args = parser.parse_args(argv)
    if args.mode == "receive":
        print(json.dumps(receive(args.port, args.warmup, args.interface, args.timeout)), flush=True)
    else:
        print(json.dumps({"sent_bytes": send(args.host, args.port, args.seconds, args.timeout)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
