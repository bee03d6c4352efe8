"""No half-healed replica: a recovered state whose last part fails to load leaves the replica exactly as it was."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_hetero.comm.validation import PeerPayloadError

pytest.importorskip("torchft")
pytest.importorskip("safetensors")
from torchft.coordination import LighthouseServer  # noqa: E402

from lightning_hetero.ft.replicas import FaultTolerantReplica  # noqa: E402
from lightning_hetero.ft.settings import FaultToleranceSettings  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_a_heal_failing_in_its_last_part_rolls_everything_back():
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    position = {"batch": 4}

    def set_position(value: dict) -> None:
        if value["batch"] < 0:
            raise ValueError("batch must be >= 0")
        position.update(value)

    settings = FaultToleranceSettings(
        lighthouse=lighthouse.address(), replica_id_source="fixed", replica_id="h0", timeout_s=5
    )
    replica = FaultTolerantReplica(
        settings,
        model=model,
        optimizer=optimizer,
        extra_state={"position": (lambda: dict(position), set_position)},
        store_host="localhost",
    )
    try:
        before = copy.deepcopy(replica.state_dict())
        rng = torch.get_rng_state()
        forged = copy.deepcopy(before)
        forged["model"]["weight"].fill_(7.0)
        forged["optimizer"]["state"][0]["exp_avg"].fill_(3.0)
        forged["rng"]["torch"] = torch.Generator().manual_seed(99).get_state()
        forged["extra"]["position"] = {"batch": -1}  # loads last, and fails
        with pytest.raises(PeerPayloadError, match="own state was restored"):
            replica.load_state_dict(forged)
        assert torch.equal(model.weight, before["model"]["weight"])
        assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], before["optimizer"]["state"][0]["exp_avg"])
        assert torch.equal(torch.get_rng_state(), rng) and position == {"batch": 4}
    finally:
        replica.shutdown()
        lighthouse.shutdown()


def _member_step(address: str, index: int, scale: float) -> dict:
    torch.manual_seed(index)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = FaultToleranceSettings(
        lighthouse=address, min_replicas=3, replica_id_source="fixed", replica_id=f"m{index}", timeout_s=20
    )
    replica = FaultTolerantReplica(settings, model=model, optimizer=optimizer, store_host="localhost")
    try:
        replica.start_step()  # the first quorum syncs the weights (init_sync): every member starts equal
        torch.manual_seed(100 + index)
        model(torch.randn(8, 4)).square().mean().backward()
        own = [p.grad.clone() for p in model.parameters()]
        for param in model.parameters():
            param.grad.mul_(scale)
        replica.average_gradients(model.parameters())
        return {
            "own": own,
            "mean": [p.grad.clone() for p in model.parameters()],
            "commit": replica.should_commit(),
            "dropped": replica.dropped_contributions,
            "slot": replica.manager.participating_rank(),
        }
    finally:
        replica.shutdown()


@pytest.mark.parametrize("scale", [float("nan"), 1e4], ids=["nan", "outlier"])
def test_a_member_s_nan_or_outlier_gradient_is_left_out_on_every_replica_and_the_step_commits(scale):
    from concurrent.futures import ThreadPoolExecutor

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=3, join_timeout_ms=300)
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(_member_step, lighthouse.address(), i, scale if i == 2 else 1.0) for i in range(3)]
            results = [future.result() for future in futures]
    finally:
        lighthouse.shutdown()
    assert all(r["commit"] and r["dropped"] == 1 for r in results), results
    for result in results:  # the same mean everywhere: the two honest gradients, summed in slot order
        honest = sorted((r for r in results[:2]), key=lambda r: r["slot"])
        expected = [(a + b) / 2 for a, b in zip(honest[0]["own"], honest[1]["own"], strict=True)]
        for mine, want in zip(result["mean"], expected, strict=True):
            assert torch.equal(mine, want)
