"""Which Lightning precisions FlexDeMo accepts, and the FSDP2 compute dtype each one implies."""

from __future__ import annotations

import torch

__all__ = ["SUPPORTED_PRECISIONS", "check_precision", "compute_dtype_for"]

SUPPORTED_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "16-true", "64-true")


def check_precision(precision: str, owner: str = "FlexDeMoStrategy") -> None:
    """Reject precisions that cannot keep replicas identical.

    Raises:
        ValueError: ``16-mixed`` (each replica's GradScaler would skip steps on its own gradients and the replicas
            would drift apart) or a precision FSDP2 cannot shard with.
    """
    if str(precision) not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"{owner} does not support precision={precision!r}: fp16 mixed precision needs a GradScaler, which skips "
            f"steps per replica and breaks the identical-replica invariant. Use one of {list(SUPPORTED_PRECISIONS)} "
            "('bf16-mixed' on GPUs)."
        )


def compute_dtype_for(precision: str) -> torch.dtype | None:
    """FSDP2 ``MixedPrecisionPolicy.param_dtype`` for a precision: bf16 for ``bf16-mixed``, else None (as stored).

    Gradients are then reduced in fp32 and stored in the fp32 sharded parameters' dtype; the replicating optimizer's
    momentum stays fp32.
    """
    return torch.bfloat16 if str(precision) == "bf16-mixed" else None
