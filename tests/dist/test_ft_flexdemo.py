"""FlexDeMo's fault-tolerant mode in the Lightning Trainer, as separate processes: a lighthouse (started here) and 3
replica groups of one rank each (tests/dist/ft_group_trainer_worker.py: ``Trainer(strategy=FlexDeMoStrategy(settings=
FlexDeMoSettings(fault_tolerance=...)))``, DeMo replication, gloo on CPU), each started like a one-rank torchrun job
of its own (``RANK=0``, ``WORLD_SIZE=1``, its own ``MASTER_PORT``, ``REPLICA_GROUP_ID``).

One replica group is SIGKILLed mid-run: the survivors step on without a restart (same pid, the committed step keeps
rising, 2 participants). It is restarted, rejoins, is healed through the pickle-free transport and, after its first
committed step, its weights equal the survivors' bit for bit; at the end all three are identical. Lightning's
``global_step`` counts committed steps on every node (the rejoined one takes the survivors' count), the rejoined node's
data continues at the survivors' position of its own stream, ``max_steps`` stops all three at the same step, and
``comm/inter/bytes_sent_step`` is what each node handed to torchft's Manager by the ledger's ring rule.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torchft")
pytest.importorskip("safetensors")

from tests.dist.ft_support import lighthouse_and_nodes, read_records, start_node, wait_for  # noqa: E402

WORKER = Path(__file__).resolve().parent / "ft_group_trainer_worker.py"


def _steps(out: Path, replica: int, *, final: bool = False) -> list[dict]:
    return read_records(out / f"group_{replica}_rank_0.jsonl", final=final)


def _start(address: str, replica: int, out: Path, *extra: str) -> subprocess.Popen:
    """Replica group ``replica``: one rank, its own launch; two of them must be present to step."""
    options = ("--min-replicas", "2", "--step-sleep", "0.05", "--forbid-pickle", *extra)
    (proc,) = start_node(WORKER, address, replica, out, 1, *options).values()
    return proc


@pytest.mark.timeout(900)
def test_a_killed_trainer_replica_group_leaves_the_survivors_stepping_and_rejoins_bit_identical(tmp_path):
    with lighthouse_and_nodes() as (address, procs):
        for replica in range(3):
            procs[str(replica)] = _start(address, replica, tmp_path)
        wait_for(
            lambda: all(len([r for r in _steps(tmp_path, i) if r["participants"] == 3]) >= 3 for i in range(3)),
            "3 replica groups to commit 3 steps together",
            procs,
        )
        survivors_pids = {i: _steps(tmp_path, i)[-1]["pid"] for i in (0, 1)}

        procs["2"].send_signal(signal.SIGKILL)
        procs["2"].wait()
        killed_at = max(r["step"] for r in _steps(tmp_path, 2))
        survivors = {k: v for k, v in procs.items() if k != "2"}
        wait_for(
            lambda: all(len([r for r in _steps(tmp_path, i) if r["participants"] == 2]) >= 3 for i in (0, 1)),
            "the survivors to commit 3 steps as 2",
            survivors,
        )
        before_rejoin = len(_steps(tmp_path, 2))

        procs["2"] = _start(address, 2, tmp_path)
        wait_for(
            lambda: len(_steps(tmp_path, 2)) > before_rejoin, "the restarted replica group to commit a step", procs
        )
        first = _steps(tmp_path, 2)[before_rejoin]
        assert first["pid"] != _steps(tmp_path, 2)[0]["pid"], "the restarted replica group is a new process"
        assert first["step"] > killed_at + 3, (first, killed_at)  # it joined at the survivors' step, not at 0
        assert first["global_step"] == first["step"], first  # Lightning's counter took the survivors' committed count
        wait_for(
            lambda: all(any(r["step"] == first["step"] for r in _steps(tmp_path, i)) for i in (0, 1)), "peers", procs
        )
        peers_index = set()
        for i in (0, 1):
            peer = next(r for r in _steps(tmp_path, i) if r["step"] == first["step"])
            assert peer["digest"] == first["digest"], f"the rejoined group differs from group {i} after its first step"
            assert peer["participants"] == first["participants"] == 3
            peers_index.add(peer["batch_index"])
        # Its data position followed: the batch of its own stream at the survivors' position, not its batch 0 (a
        # survivor healed in place keeps its own position, so match either survivor).
        assert first["batch_index"] in peers_index and first["batch_index"] > killed_at, (first, peers_index)

        # A replica group whose own layout differs (hidden width 24): the recovery a live peer sends is refused, and
        # the PeerPayloadError comes out of trainer.fit naming the peer and the field.
        procs["impostor"] = _start(address, 3, tmp_path, "--hidden", "24")  # no _wait after this: it exits 3
        assert procs["impostor"].wait(timeout=300) == 3
        error = (tmp_path / "group_3.error").read_text()
        assert "PeerPayloadError" in error and "recovery checkpoint from replica" in error, error
        assert "this replica holds F32 [24, 8]" in error, error

        last = max(r["step"] for i in range(3) for r in _steps(tmp_path, i))
        stop = last + 3
        (tmp_path / "stop").write_text(str(stop))  # becomes every node's max_steps
        for name in ("0", "1", "2"):
            assert procs[name].wait(timeout=120) == 0, f"replica group {name} failed"

        finals = [_steps(tmp_path, i, final=True)[0] for i in range(3)]
        assert len({f["digest"] for f in finals}) == 1, finals
        assert [f["global_step"] for f in finals] == [stop] * 3, finals  # max_steps stopped all at the same step
        for i in range(3):
            for record in _steps(tmp_path, i):
                assert record["global_step"] == record["step"], record  # global_step counts committed steps
        # From there on, one batch of its own stream per committed step (a node left out of a quorum is healed in
        # place later and keeps its position, so the step may jump while the batches stay consecutive).
        rejoined = [r["batch_index"] for r in _steps(tmp_path, 2)[before_rejoin:]]
        assert rejoined == list(range(rejoined[0], rejoined[0] + len(rejoined))), rejoined
        # The bytes handed to the Manager (DeMo: a gather wire, one all-gather of the payload S plus its 32-byte HMAC
        # tag, one bucket per step without overlap) are counted: (n - 1) (S + 32) per step, for a step committed at
        # its first try.
        for i in range(3):
            for record in _steps(tmp_path, i):
                if record["retries"] == 0:
                    expected = (record["participants"] - 1) * (record["payload_bytes"] + 32)
                    assert record["inter_bytes_sent"] == expected > 0, record
        committed: set[int] = set()
        for i in (0, 1):
            steps = [r["step"] for r in _steps(tmp_path, i)]
            committed.update(steps)
            # Never repeated, never reset: a survivor whose commit failed while the other's succeeded is healed in
            # place at the next quorum and goes on from the newer step.
            assert all(b > a for a, b in zip(steps, steps[1:], strict=False)), f"group {i} went back: {steps}"
            assert {r["pid"] for r in _steps(tmp_path, i)} == {survivors_pids[i]}, "a survivor was restarted"
            counts = [r["participants"] for r in _steps(tmp_path, i)]
            assert 2 in counts and counts[-1] == 3, counts
        assert committed == set(range(1, max(committed) + 1)), "the survivors together lost a committed step"
