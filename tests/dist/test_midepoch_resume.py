"""Exact mid-epoch resume for every strategy: stop at step 7 of a 20-step epoch, resume, compare bit for bit.

Each case (:data:`lightning_hetero.testing.resume.CASES`) spawns 2 gloo ranks and runs three Trainer fits of a tiny
model on shuffled data served by :class:`~lightning_hetero.data.stateful.StatefulDataLoader`: an uninterrupted
20-step epoch, the same fit checkpointed and stopped at step 7, and a fresh fit resumed from that checkpoint. The
resumed run must train on exactly the batches the uninterrupted one trained on after step 7 (a plain loader would
start the epoch over) and end with bitwise-equal parameters, optimizer state (moments, error feedback, replicator
state) and strategy state (codec error feedback, subspace bases, ...) on every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_hetero.testing import run_distributed
from lightning_hetero.testing.resume import CASES, resume_case

STOP, STEPS = 7, 20


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("case", sorted(CASES))
def test_stop_at_step_7_and_resume_equals_an_uninterrupted_epoch(case: str, tmp_path: Path) -> None:
    ranks = run_distributed(resume_case, 2, case, tmp_path, STOP, STEPS, timeout=1200)
    for result in ranks:
        assert result["restart_would_differ"], result  # the data order makes an epoch restart visible
        assert (result["stopped_at"], result["resumed_steps"]) == (STOP, STEPS - STOP), result
        assert result["same_batches"], result  # the resumed fit continued with batch 8 of the epoch
        assert result["equal"] and result["max_abs_diff"] == 0.0, result
