"""Waiting below min_replicas (or for a lighthouse): a clear line per failed quorum attempt, a deadline, then a
verified checkpoint and an error that says how to resume; torchft's raw TimeoutError never reaches the user alone."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch

from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.ft.waiting import QuorumWait, ReplicasBelowMinimumError, lighthouse_presence

RAW = 'status: Cancelled, message: "Timeout expired", details: [], metadata: MetadataMap { headers: {} }'


def _settings(**extra) -> FaultToleranceSettings:
    base = {"lighthouse": "http://head:29510", "min_replicas": 2, "quorum_timeout_s": 30, "replica_id": "x"}
    return FaultToleranceSettings(replica_id_source="fixed", **{**base, **extra})


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _failing(clock: _Clock, failures: int, error: Exception, timeouts: list[timedelta]):
    def attempt(timeout: timedelta) -> None:
        timeouts.append(timeout)
        if len(timeouts) <= failures:
            clock.now += timeout.total_seconds()
            raise error

    return attempt


def test_failed_quorums_are_asked_again_with_a_line_each_until_one_succeeds(caplog):
    clock, timeouts, resets = _Clock(), [], []
    wait = QuorumWait(_settings(wait_for_replicas_s=600), clock=clock, presence=lambda address: 1)
    with caplog.at_level(logging.WARNING, logger="lightning_hetero.ft"):
        wait.run(_failing(clock, 3, TimeoutError(RAW), timeouts), lambda: resets.append(1))
    assert timeouts == [timedelta(seconds=30)] * 4  # each attempt: quorum_timeout_s
    assert len(resets) == 3 and wait.waited_s == 90
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [
        "waiting for replicas: 1 of min_replicas 2 present, deadline in 570 s",
        "waiting for replicas: 1 of min_replicas 2 present, deadline in 540 s",
        "waiting for replicas: 1 of min_replicas 2 present, deadline in 510 s",
    ]
    assert lines[3] == "quorum reached after waiting 90 s; training goes on"
    assert not any("Cancelled" in line for line in lines)


def test_past_the_deadline_the_wait_ends_in_an_error_that_names_the_setting_and_hides_torchfts():
    clock = _Clock()
    wait = QuorumWait(_settings(wait_for_replicas_s=60, quorum_timeout_s=20), clock=clock, presence=lambda a: 1)
    with pytest.raises(ReplicasBelowMinimumError) as caught:
        wait.run(_failing(clock, 99, TimeoutError(RAW), []), lambda: None)
    error = caught.value
    assert isinstance(error.__cause__, TimeoutError)
    assert error.waited_s == 60 and error.present == 1
    message = str(error)
    assert "only 1 of min_replicas 2 replica groups were present for 60 s" in message
    assert "wait_for_replicas_s=60" in message and "Cancelled" not in message
    error.checkpoint = "/ckpt/below.ckpt"
    assert "saved and verified in /ckpt/below.ckpt" in str(error) and "--ckpt_path /ckpt/below.ckpt" in str(error)


def test_a_dead_lighthouse_is_waited_for_and_named(caplog):
    clock = _Clock()
    error = RuntimeError('status: Unknown, message: "transport error", details: []')
    wait = QuorumWait(_settings(wait_for_replicas_s=None), clock=clock, presence=lambda a: None)
    with caplog.at_level(logging.WARNING, logger="lightning_hetero.ft"):
        wait.run(_failing(clock, 2, error, []), lambda: None)
    assert caplog.records[0].getMessage() == (
        "waiting for the lighthouse: http://head:29510 is unreachable (the quorum request failed: transport error), "
        "deadline none"
    )


def test_enough_replicas_present_but_no_quorum_is_said_as_such(caplog):
    clock = _Clock()
    wait = QuorumWait(_settings(wait_for_replicas_s=40), clock=clock, presence=lambda a: 3)
    with (
        caplog.at_level(logging.WARNING, logger="lightning_hetero.ft"),
        pytest.raises(ReplicasBelowMinimumError) as caught,
    ):
        wait.run(_failing(clock, 99, TimeoutError(RAW), []), lambda: None)
    assert caplog.records[0].getMessage() == (
        "waiting for the quorum: 3 replica groups present (min_replicas 2), deadline in 10 s"
    )
    assert "no quorum formed (3 replica groups heartbeating, min_replicas 2) for 60 s" in str(caught.value)


def test_errors_that_are_not_a_failed_quorum_request_pass_through():
    wait = QuorumWait(_settings(), clock=_Clock(), presence=lambda a: 1)

    def attempt(timeout: timedelta) -> None:
        raise RuntimeError("a bug of ours")

    with pytest.raises(RuntimeError, match="a bug of ours"):
        wait.run(attempt, lambda: None)


def test_presence_is_read_from_the_lighthouse_status_page():
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        assert lighthouse_presence(server.address()) == 0
    finally:
        server.shutdown()
    assert lighthouse_presence("http://localhost:1") is None


# ------------------------------------------------------------------------------------------------ in the Trainer


class _Module(__import__("lightning").LightningModule):
    def __init__(self, on_step=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.on_step = on_step
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        inputs, target, index = batch
        self.seen[batch_idx] = index.tolist()  # a retried try overwrites its own entry
        return torch.nn.functional.mse_loss(self.net(inputs), target)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.on_step is not None:
            self.on_step(self.trainer)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _loader():
    from torch.utils.data import TensorDataset

    from lightning_hetero.data.stateful import StatefulDataLoader

    inputs = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True), torch.arange(64))
    return StatefulDataLoader(dataset, batch_size=8, shuffle=True, seed=4)


def _trainer(tmp_path, lighthouse: str, steps: int, min_replicas: int = 1):
    import lightning as L

    from lightning_hetero.flexdemo.settings import FlexDeMoSettings
    from lightning_hetero.replication import ReplicationSettings
    from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy

    ft = _settings(
        lighthouse=lighthouse, min_replicas=min_replicas, quorum_timeout_s=1, wait_for_replicas_s=2, timeout_s=10
    )
    settings = FlexDeMoSettings(replication=ReplicationSettings(kind="demo", chunk=4), fault_tolerance=ft)
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FlexDeMoStrategy(settings=settings),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


@pytest.mark.timeout(180)
def test_a_trainer_below_min_replicas_waits_then_saves_a_verified_checkpoint_and_says_how_to_resume(tmp_path, caplog):
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    from lightning_hetero.reliability.checkpoints import verify_checkpoint

    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100)  # this node alone: never a quorum
    try:
        trainer = _trainer(tmp_path, server.address(), steps=5, min_replicas=2)
        with caplog.at_level(logging.WARNING, logger="lightning_hetero"):
            with pytest.raises(ReplicasBelowMinimumError) as caught:
                trainer.fit(_Module(), _loader())
    finally:
        server.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for replicas")]
    assert lines and lines[0] == "waiting for replicas: 1 of min_replicas 2 present, deadline in 1 s", lines
    path = tmp_path / "checkpoints" / "below-min-replicas-step=0.ckpt"
    assert caught.value.checkpoint == str(path)
    assert verify_checkpoint(path)["step"] == 0
    assert f"--ckpt_path {path}" in str(caught.value)


def _lighthouse_process(port: int):
    import os
    import subprocess

    # A member of the last quorum that left (an earlier fit here) holds the next quorum until its heartbeat expires:
    # 500 ms, not the default 5 s, which is past the resumed fits' wait_for_replicas_s of 2 s.
    command = ["torchft_lighthouse", "--bind", f"[::]:{port}", "--min_replicas", "1", "--join_timeout_ms", "100"]
    command += ["--heartbeat_timeout_ms", "500"]
    env = {**os.environ, "RUST_LOG": "error"}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.timeout(180)
def test_a_lighthouse_gone_past_the_deadline_keeps_the_committed_steps_and_the_run_resumes_from_them(tmp_path):
    import socket
    import time

    pytest.importorskip("torchft")
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    address = f"http://localhost:{port}"
    lighthouse = _lighthouse_process(port)
    try:
        while lighthouse_presence(address) is None:  # up and serving
            time.sleep(0.05)

        def kill_after_three(trainer) -> None:
            if trainer.global_step == 3:
                lighthouse.kill()
                lighthouse.wait()

        module = _Module(kill_after_three)
        # Under load the deadline can pass while the dying lighthouse still answers: either message is this stop.
        stopped = "the lighthouse at .* was unreachable|no quorum formed"
        with pytest.raises(ReplicasBelowMinimumError, match=stopped) as caught:
            _trainer(tmp_path, address, steps=6).fit(module, _loader())
        checkpoint = caught.value.checkpoint
        assert checkpoint is not None and checkpoint.endswith("below-min-replicas-step=3.ckpt")
        weights = [p.detach().clone() for p in module.parameters()]

        lighthouse = _lighthouse_process(port)
        resumed = _Module()
        trainer = _trainer(tmp_path, address, steps=3)
        trainer.fit(resumed, _loader(), ckpt_path=checkpoint)  # max_steps 3 reached: the saved state, untouched
        assert trainer.global_step == 3
        assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), weights, strict=True))
        resumed = _Module()
        _trainer(tmp_path, address, steps=6).fit(resumed, _loader(), ckpt_path=checkpoint)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    lighthouse = _lighthouse_process(port)  # a fresh one: no heartbeat of the runs above
    try:
        reference = _Module()
        _trainer(tmp_path / "reference", address, steps=6).fit(reference, _loader())
    finally:
        lighthouse.kill()
        lighthouse.wait()
    # The batch in flight when the wait began (batch 3) was never committed: the resumed run trains it, then goes on.
    assert sorted(module.seen) == [0, 1, 2] and sorted(resumed.seen) == [3, 4, 5]
    assert {**module.seen, **resumed.seen} == reference.seen
