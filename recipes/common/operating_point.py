"""The operating point R of a benchmark: how much longer a stock baseline spends on the wire than computing.

``R = link seconds per step / compute seconds per step`` of the *stock baseline* (DDP, HSDP, the uncompressed
pipeline) at the configured bandwidth, where the link seconds are its measured inter-node bytes per step divided by
the bandwidth, and the compute seconds its measured step time without communication. R < 1 means the step is
compute-bound and no communication-efficient method can gain much; our users train at R = 10-100. Every benchmark
prints and stores R next to its speedups (see ``docs/benchmarks.md#operating-point``).

The projection helpers give R for model sizes that do not fit this machine from the same two quantities: bytes per
step (an all-reduce of the gradients moves ``2 (n - 1) / n`` times their size over each node's link) and FLOPs per
step (``6 N T`` for the matmul parameters ``N`` plus ``6 L s d T`` for attention scores, over ``T`` tokens), divided
by a stated throughput. They are projections, labelled as such wherever they are printed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from lightning_hetero.comm.units import parse_bandwidth

#: Dense bf16 throughput of one H100 SXM (989 TFLOP/s) at a 40% model-FLOPs utilisation, for projections.
H100_BF16_FLOPS_AT_40_PCT_MFU = 0.4 * 989e12


@dataclass(frozen=True)
class OperatingPoint:
    """R and the two measurements it is made of.

    Attributes:
        link_s: Baseline inter-node bytes per step / bandwidth, in seconds.
        compute_s: Baseline step time without communication, in seconds.
        ratio: ``link_s / compute_s`` (the R of the docs).
        bandwidth_bits_per_s: The link rate the link time was taken at.
        link_bytes_per_step: The bytes the link time was computed from.
    """

    link_s: float
    compute_s: float
    ratio: float
    bandwidth_bits_per_s: float
    link_bytes_per_step: float

    def as_dict(self) -> dict[str, float]:
        """The fields, rounded for JSON reports."""
        return {key: round(value, 4) for key, value in asdict(self).items()}


def link_seconds(bytes_per_step: float, bandwidth: str | float) -> float:
    """Seconds ``bytes_per_step`` bytes take at ``bandwidth`` (a tc-style rate such as ``"100mbit"`` or bits/s)."""
    if not math.isfinite(bytes_per_step) or bytes_per_step < 0:
        raise ValueError(f"bytes_per_step must be a finite number >= 0, got {bytes_per_step!r}")
    return 8.0 * bytes_per_step / parse_bandwidth(bandwidth)


def operating_point(link_bytes_per_step: float, bandwidth: str | float, compute_seconds: float) -> OperatingPoint:
    """R of a baseline from its measured inter-node bytes per step and its measured compute time per step.

    Args:
        link_bytes_per_step: The baseline's bytes per step over one node's inter-node link (the busier direction).
        bandwidth: The configured link rate.
        compute_seconds: The baseline's step time with no communication (one process, same micro-batch).

    Raises:
        ValueError: ``compute_seconds`` is not a positive finite number (or the bytes/bandwidth are invalid).
    """
    if not math.isfinite(compute_seconds) or compute_seconds <= 0:
        raise ValueError(f"compute_seconds must be a positive number of seconds, got {compute_seconds!r}")
    link = link_seconds(link_bytes_per_step, bandwidth)
    return OperatingPoint(
        link_s=link,
        compute_s=compute_seconds,
        ratio=link / compute_seconds,
        bandwidth_bits_per_s=parse_bandwidth(bandwidth),
        link_bytes_per_step=float(link_bytes_per_step),
    )


def physical_limit_ratio(
    step_seconds: float, compute_seconds: float, link_bytes_per_step: float, bandwidth: str | float
) -> float:
    """``step / max(compute, bytes / bandwidth)``: 1.0 is a step as fast as its slower resource allows.

    A method that hides its exchange behind compute approaches 1; one that computes, then waits for the wire,
    approaches ``(compute + link) / max(compute, link)`` (up to 2).
    """
    bound = max(compute_seconds, link_seconds(link_bytes_per_step, bandwidth))
    if bound <= 0:
        raise ValueError("compute_seconds and link_bytes_per_step are both zero: no lower bound to compare with")
    return step_seconds / bound


def allreduce_link_bytes(num_values: int, bytes_per_value: float, num_nodes: int) -> float:
    """Bytes one node sends (and receives) per all-reduce of ``num_values`` values: ring/bucketed, ``2 (n-1)/n S``."""
    if num_nodes < 2:
        raise ValueError(f"num_nodes must be >= 2 for inter-node traffic, got {num_nodes}")
    return 2.0 * (num_nodes - 1) / num_nodes * num_values * bytes_per_value


def training_flops_per_step(matmul_params: int, num_layers: int, hidden_size: int, seq_len: int, tokens: int) -> float:
    """Forward + backward FLOPs of one step over ``tokens`` tokens: ``6 N T + 6 L s d T``.

    ``matmul_params`` counts the weights used in matrix products (the input embedding lookup is not one; a tied LM
    head is). The second term is the attention-score and value products at sequence length ``s``.
    """
    return 6.0 * matmul_params * tokens + 6.0 * num_layers * seq_len * hidden_size * tokens


@dataclass(frozen=True)
class ModelShape:
    """The few numbers a projection needs about a model."""

    name: str
    params: int
    matmul_params: int
    num_layers: int
    hidden_size: int


#: Public shapes of the models our users train (parameter counts from their HF configs).
PROJECTION_MODELS: tuple[ModelShape, ...] = (
    # Llama-3.2-1B: tied 128,256 x 2,048 embedding (used again as the LM head).
    ModelShape("Llama-3.2-1B", params=1_235_814_400, matmul_params=1_235_814_400, num_layers=16, hidden_size=2048),
    # Llama-3.1-8B: untied embedding (525M) and LM head; the lookup is not a matmul.
    ModelShape("Llama-3.1-8B", params=8_030_261_248, matmul_params=7_504_924_672, num_layers=32, hidden_size=4096),
)


def project_operating_point(
    shape: ModelShape,
    *,
    tokens_per_step: int,
    seq_len: int,
    bandwidth: str | float,
    flops_per_second: float,
    num_nodes: int = 2,
    gradient_bytes_per_value: float = 4.0,
    wire_overhead: float = 1.0,
) -> dict[str, float | str]:
    """Projected R of a DDP/HSDP all-reduce baseline for ``shape`` (a projection, not a measurement).

    Args:
        shape: The model.
        tokens_per_step: Tokens one accelerator (rank) processes per optimizer step.
        seq_len: Sequence length (attention term of the FLOPs).
        bandwidth: Inter-node link rate.
        flops_per_second: Sustained training throughput of one rank.
        num_nodes: Nodes in the all-reduce.
        gradient_bytes_per_value: 4 for fp32 gradient reduction (DDP default), 2 for bf16.
        wire_overhead: Measured wire bytes / payload bytes (TCP/IP, framing), e.g. from the baseline benchmark.
    """
    link_bytes = allreduce_link_bytes(shape.params, gradient_bytes_per_value, num_nodes) * wire_overhead
    flops = training_flops_per_step(shape.matmul_params, shape.num_layers, shape.hidden_size, seq_len, tokens_per_step)
    compute = flops / flops_per_second
    point = operating_point(link_bytes, bandwidth, compute)
    return {"model": shape.name, "params": shape.params, "flops_per_step": flops, **point.as_dict()}
