"""Fault injection for reliability runs: kill, stop or corrupt at a chosen step on a chosen rank.

A fault is described by one string, usually passed through the environment variable ``LIGHTNING_HETERO_FAULT`` so
that the same training script runs with and without it::

    kill:rank=1:step=7            SIGKILL rank 1 after optimizer step 7 (as ``kill -9`` from outside would)
    stop:rank=3:step=5            SIGSTOP rank 3 after step 5: a hung peer (it never answers again)
    save-kill:rank=1:step=8       SIGKILL rank 1 while the checkpoint of step 8 is being saved
    corrupt-kill:rank=0:step=10   flip bytes in the newest checkpoint's largest file, then SIGKILL rank 0

By default a fault fires only in the first attempt of an elastic job (``TORCHELASTIC_RESTART_COUNT`` 0, or unset),
so the restarted job runs clean; ``attempt=any`` fires in every attempt. Framework-free: the Lightning callback that
calls :meth:`FaultPlan.maybe_fire` lives in the training script.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV_VAR", "FAULT_KINDS", "FaultPlan", "corrupt_file", "restart_count"]

ENV_VAR = "LIGHTNING_HETERO_FAULT"
FAULT_KINDS = ("kill", "stop", "save-kill", "corrupt-kill")


def restart_count() -> int:
    """How many times the elastic agent restarted this job (``TORCHELASTIC_RESTART_COUNT``; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def corrupt_file(path: str | os.PathLike, offset_fraction: float = 0.5, count: int = 16) -> int:
    """Invert ``count`` bytes of ``path`` in place, at ``offset_fraction`` of its length (a silent disk corruption).

    Returns the offset of the first byte changed.
    """
    target = Path(path)
    size = target.stat().st_size
    if size == 0:
        raise ValueError(f"{target} is empty; there is nothing to corrupt.")
    offset = min(int(size * offset_fraction), max(0, size - count))
    with open(target, "r+b") as stream:
        stream.seek(offset)
        original = stream.read(count)
        stream.seek(offset)
        stream.write(bytes(b ^ 0xFF for b in original))
        stream.flush()
        os.fsync(stream.fileno())
    return offset


@dataclass(frozen=True)
class FaultPlan:
    """One fault: ``kind`` on global rank ``rank`` at global step ``step`` (in restart ``attempt``; None: every)."""

    kind: str
    rank: int
    step: int
    attempt: int | None = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"Unknown fault kind {self.kind!r} in {ENV_VAR}; choose one of {', '.join(FAULT_KINDS)}.")
        if self.rank < 0 or self.step < 1:
            raise ValueError(f"{ENV_VAR}: rank must be >= 0 and step >= 1, got rank={self.rank}, step={self.step}.")

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """Parse ``"kind:rank=R:step=S[:attempt=A|any]"``.

        Raises:
            ValueError: malformed; the message shows the expected form.
        """
        kind, *fields = spec.strip().split(":")
        values: dict[str, str] = {}
        for item in fields:
            key, sep, value = item.partition("=")
            if not sep or key not in ("rank", "step", "attempt"):
                raise ValueError(f"{ENV_VAR}={spec!r}: expected 'kind:rank=R:step=S[:attempt=A|any]', got {item!r}.")
            values[key] = value
        if "rank" not in values or "step" not in values:
            raise ValueError(f"{ENV_VAR}={spec!r}: rank=R and step=S are required.")
        attempt = values.get("attempt", "0")
        return cls(kind, int(values["rank"]), int(values["step"]), None if attempt == "any" else int(attempt))

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        """The plan in ``LIGHTNING_HETERO_FAULT``, or None when unset or empty."""
        spec = os.environ.get(ENV_VAR, "").strip()
        return cls.parse(spec) if spec else None

    def applies(self, kind: str, rank: int, step: int) -> bool:
        """Whether this plan fires for ``kind`` on ``rank`` at ``step`` in the current elastic attempt."""
        if (self.kind, self.rank, self.step) != (kind, rank, step):
            return False
        return self.attempt is None or self.attempt == restart_count()

    def maybe_fire(self, kind: str, rank: int, step: int, checkpoint_dir: str | os.PathLike | None = None) -> bool:
        """Fire the fault if it applies (kill and corrupt-kill do not return); True if it fired (stop resumes only
        after SIGCONT)."""
        if not self.applies(kind, rank, step):
            return False
        print(f"[fault] {self.kind} on rank {rank} at step {step} (pid {os.getpid()}, t={time.time():.3f})", flush=True)
        if self.kind == "corrupt-kill":
            if checkpoint_dir is None:
                raise ValueError("corrupt-kill needs the checkpoint directory.")
            self._corrupt_newest(Path(checkpoint_dir))
        signo = signal.SIGSTOP if self.kind == "stop" else signal.SIGKILL
        os.kill(os.getpid(), signo)
        return True

    @staticmethod
    def _corrupt_newest(directory: Path) -> None:
        from lightning_hetero.reliability.checkpoints import scan_checkpoints

        scan = scan_checkpoints(directory)
        if not scan.good:
            raise RuntimeError(f"corrupt-kill: no complete checkpoint in {directory} to corrupt yet.")
        newest = scan.good[0]
        files = [newest] if newest.is_file() else [p for p in newest.rglob("*.pt") if p.is_file()]
        largest = max(files, key=lambda p: p.stat().st_size)
        offset = corrupt_file(largest)
        print(f"[fault] corrupted {largest} at byte {offset}", flush=True)
