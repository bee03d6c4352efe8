"""Link-shaping parameters: the tbf token bucket of a throttled testbed link (pure arithmetic, nothing runs here).

Both :mod:`~lightning_hetero.testbed.checks` (which validates the rate) and :mod:`~lightning_hetero.testbed.netns`
(which attaches the qdiscs) use these, so they live below both.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["TbfParameters", "tbf_parameters"]

#: Token bucket depth: enough for 5 ms of traffic (timer and scheduling slack on a busy 2-core box must not cost
#: throughput), never less than 16 KiB (~10 full Ethernet frames).
BURST_SECONDS = 0.005
MIN_BURST_BYTES = 16 * 1024
#: Queue behind the bucket: 50 ms of traffic, at least 64 KiB, so several senders converging on one node's downlink
#: queue briefly instead of being dropped at once (a modest switch buffer).
QUEUE_SECONDS = 0.05
MIN_QUEUE_BYTES = 64 * 1024


@dataclass(frozen=True)
class TbfParameters:
    """One tbf qdisc: ``tc qdisc add dev X root tbf rate <rate>bit burst <burst> limit <limit>`` (sizes in bytes)."""

    rate_bits_per_second: int
    burst_bytes: int
    limit_bytes: int

    def tc_arguments(self) -> list[str]:
        """The arguments after ``tbf`` (a bare size is bytes in tc)."""
        return [
            "rate",
            f"{self.rate_bits_per_second}bit",
            "burst",
            str(self.burst_bytes),
            "limit",
            str(self.limit_bytes),
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)


def tbf_parameters(bits_per_second: float) -> TbfParameters:
    """Token-bucket settings that let one TCP flow reach the set rate (selftest: within 10%).

    Offloads are disabled on every testbed veth (``gso_max_segs 1``), so no packet exceeds one 1514-byte frame and
    the bucket never has to hold a 64 KB GSO super-packet.

    Args:
        bits_per_second: The link rate.

    Returns:
        Rate rounded to whole bits/s, burst ``max(16 KiB, 5 ms of traffic)`` and queue limit ``burst + max(64 KiB,
        50 ms of traffic)``.
    """
    bytes_per_second = bits_per_second / 8.0
    burst = max(MIN_BURST_BYTES, math.ceil(bytes_per_second * BURST_SECONDS))
    limit = burst + max(MIN_QUEUE_BYTES, math.ceil(bytes_per_second * QUEUE_SECONDS))
    return TbfParameters(rate_bits_per_second=round(bits_per_second), burst_bytes=burst, limit_bytes=limit)
