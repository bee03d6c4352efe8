"""FaultTolerantReplica on a real lighthouse, with replica groups as threads of this process (gloo on CPU).

A late replica is healed through our transport (pickle and torch.load are made to raise) and is bit-identical to the
others after its first step; replicators exchange through the Manager with the participant count.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import pickle
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")
pytest.importorskip("safetensors")
from torchft.coordination import LighthouseServer  # noqa: E402

from lightning_hetero.ft.replicas import FaultTolerantReplica  # noqa: E402
from lightning_hetero.ft.settings import FaultToleranceSettings  # noqa: E402
from lightning_hetero.replication import DeMoReplicator, FullReplicator  # noqa: E402

pytestmark = pytest.mark.timeout(180)
_INIT = threading.Lock()


def _late_join_hooks() -> tuple[threading.Event, Callable[[int], None], Callable[[int], None]]:
    """(started, first replica's on_step, late replica's on_step): the first replica sets ``started`` at step 3 and
    waits at step 5 until the late one committed a step, so the others cannot finish before it joined (a loaded
    machine may take longer to build the late replica than the others take for their remaining steps)."""
    started, joined = threading.Event(), threading.Event()

    def first(step: int) -> None:
        if step >= 3:
            started.set()
        if step >= 5:
            assert joined.wait(120), "the late replica never committed a step"

    return started, first, lambda step: joined.set()


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=300, heartbeat_timeout_ms=2000)
    yield server.address()
    server.shutdown()


def _settings(address: str, name: str) -> FaultToleranceSettings:
    return FaultToleranceSettings(
        lighthouse=address,
        min_replicas=2,
        timeout_s=20,
        quorum_timeout_s=60,
        replica_id_source="fixed",
        replica_id=name,
    )


def _replica(address: str, name: str, seed: int) -> tuple[FaultTolerantReplica, torch.nn.Module, Any]:
    with _INIT:  # threads share the global RNG: build each model in one piece
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    replica = FaultTolerantReplica(_settings(address, name), model=model, optimizer=optimizer, store_host="localhost")
    return replica, model, optimizer


def _train(
    address: str, name: str, seed: int, steps: int, on_step: Callable[[int], None] = lambda s: None
) -> dict[str, Any]:
    replica, model, optimizer = _replica(address, name, seed)
    committed = []
    try:
        while replica.current_step() < steps:
            replica.start_step()
            batch = torch.Generator().manual_seed(1000 * replica.current_step() + seed)
            inputs = torch.randn(16, 4, generator=batch)
            model(inputs).square().mean().backward()
            replica.average_gradients(model.parameters())
            if replica.should_commit():
                optimizer.step()
                committed.append((replica.current_step(), replica.num_participants()))
            optimizer.zero_grad()
            on_step(replica.current_step())
        return {"params": [p.detach().clone() for p in model.parameters()], "committed": committed}
    finally:
        replica.shutdown()


def test_a_late_replica_is_healed_without_pickle_and_matches_after_its_first_step(lighthouse, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a recovery unpickled peer bytes")

    class RefusingUnpickler(pickle.Unpickler):  # a class: modules imported later subclass pickle.Unpickler
        def __init__(self, *args, **kwargs):
            refuse()

    # torch's streaming load (torchft's HTTP transport) unpickles through pickle.Unpickler: refuse that too.
    for module, name, value in (
        (pickle, "loads", refuse),
        (pickle, "load", refuse),
        (pickle, "Unpickler", RefusingUnpickler),
        (torch, "load", refuse),
    ):
        monkeypatch.setattr(module, name, value)
    started, on_first, on_late = _late_join_hooks()
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(_train, lighthouse, "r0", 0, 8, on_first)
        second = pool.submit(_train, lighthouse, "r1", 1, 8)
        assert started.wait(120), "the first two replicas never committed 3 steps"
        late = pool.submit(_train, lighthouse, "r2", 2, 8, on_late)  # different init: only healing makes it equal
        results = [first.result(), second.result(), late.result()]
    for mine, theirs in zip(results[2]["params"], results[0]["params"], strict=True):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(results[1]["params"], results[0]["params"], strict=True):
        assert torch.equal(mine, theirs)
    joined_at = results[2]["committed"][0][0]
    assert joined_at > 3, results[2]["committed"]  # it did not start over from step 0: it took the peers' step
    assert {count for _, count in results[0]["committed"]} == {2, 3}, results[0]["committed"]


def _exchange(address: str, name: str, seed: int, replicator_class: type) -> dict[str, Any]:
    replica, _, _ = _replica(address, name, seed)
    replicator = replicator_class(0.25, chunk=4) if replicator_class is DeMoReplicator else replicator_class(1.0)
    source = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
    try:
        replica.start_step()
        piece = replicator.encode(0, source.clone())
        bucket = replica.launch(replicator, [piece])
        (combined,) = replicator.finish(bucket)
        committed = replica.should_commit()
        return {"combined": combined, "wire": piece.wire, "piece": piece, "n": replicator.num_replicas, "ok": committed}
    finally:
        replica.shutdown()


@pytest.mark.parametrize("replicator_class", [FullReplicator, DeMoReplicator])
def test_replicators_exchange_through_the_manager_over_the_participants(lighthouse, replicator_class):
    from lightning_hetero import comm

    sent_before = comm.get_ledger().totals(comm.INTER).sent
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda seed: _exchange(lighthouse, f"x{seed}", seed, replicator_class), (0, 1)))
    assert all(r["ok"] and r["n"] == 2 for r in results)
    # The bytes handed to the Manager are counted in the ledger (label "inter"), per replica: every wire is one
    # all-gather of its payload S (float32 for a reduce wire) plus the 32-byte HMAC tag of its slot, (n-1) (S + 32).
    # Both replicas run in this process and share the global ledger.
    wire = results[0]["wire"].numel()
    per_replica = 1 * ((4 * wire if replicator_class is FullReplicator else wire) + 32)
    assert comm.get_ledger().totals(comm.INTER).sent - sent_before == 2 * per_replica
    assert torch.equal(results[0]["combined"], results[1]["combined"])
    # The same combination a plain all-gather / all-reduce would give, in participant order (which the quorum
    # assigns; either order gives the same mean up to rounding, so compare with a tolerance).
    reference = replicator_class(0.25, chunk=4) if replicator_class is DeMoReplicator else replicator_class(1.0)
    reference.num_replicas = 2
    piece = results[0]["piece"]
    if reference.wire_kind == "gather":
        expected = reference.decode_gathered(piece, [results[0]["wire"], results[1]["wire"]])
    else:
        expected = reference.decode_reduced(piece, results[0]["wire"] + results[1]["wire"])
    torch.testing.assert_close(results[0]["combined"], expected)


def _demo_train(
    address: str, name: str, seed: int, steps: int, min_replicas: int = 2, on_step=lambda s: None, replicator=None
):
    from lightning_hetero.flexdemo.optim import DeMoSGD

    with _INIT:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if replicator is None:
        optimizer = DeMoSGD(model.parameters(), lr=0.01, momentum=0.9, kept_fraction=0.25, chunk=4)
    else:
        optimizer = DeMoSGD(model.parameters(), lr=0.01, momentum=0.9, replicator=replicator())
    settings = dataclasses.replace(_settings(address, name), min_replicas=min_replicas)
    replica = FaultTolerantReplica(settings, model=model, optimizer=optimizer, store_host="localhost")
    replica.manage(optimizer.replicator)
    history = []
    try:
        while replica.current_step() < steps and len(history) < 3 * steps:
            replica.start_step()
            batch = torch.Generator().manual_seed(1000 * replica.current_step() + seed)
            model(torch.randn(16, 8, generator=batch)).square().mean().backward()
            before = ([p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict()))
            committed = replica.step_optimizer()
            history.append((committed, replica.num_participants(), before, optimizer.replicator.num_replicas))
            optimizer.zero_grad()
            on_step(replica.current_step())
        return {"params": [p.detach().clone() for p in model.parameters()], "history": history, "opt": optimizer}
    finally:
        replica.shutdown()


def test_demo_through_the_manager_heals_a_late_replica_bit_identical(lighthouse):
    started, on_first, on_late = _late_join_hooks()
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(_demo_train, lighthouse, "d0", 0, 8, 2, on_first)
        second = pool.submit(_demo_train, lighthouse, "d1", 1, 8)
        assert started.wait(120)
        late = pool.submit(_demo_train, lighthouse, "d2", 2, 8, 2, on_late)
        results = [first.result(), second.result(), late.result()]
    for other in results[1:]:
        for mine, theirs in zip(other["params"], results[0]["params"], strict=True):
            assert torch.equal(mine, theirs)
    assert {n for ok, n, _, _ in results[0]["history"] if ok} == {2, 3}
    assert all(n == replicas for _, n, _, replicas in results[0]["history"])  # DeMo's mean is over the present
    assert results[2]["opt"].replicator.step == results[0]["opt"].replicator.step  # the replicator state was healed


def test_an_uncommitted_demo_step_leaves_weights_and_state_untouched(lighthouse):
    # min_replicas=3 with 2 replica groups: the quorum forms, every step runs, none may commit.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda seed: _demo_train(lighthouse, f"g{seed}", seed, 1, min_replicas=3), (0, 1)))
    for result in results:
        history, optimizer = result["history"], result["opt"]
        assert len(history) == 3 and not any(ok for ok, *_ in history)
        weights, state = history[-1][2]
        for mine, saved in zip(result["params"], weights, strict=True):
            assert torch.equal(mine, saved)
        assert optimizer.replicator.step == 0 and state["replicator"]["step"] == 0
        for key, entry in optimizer.state_dict()["state"].items():
            assert torch.equal(entry["delta"], state["state"][key]["delta"])  # momentum + error feedback restored


@pytest.mark.parametrize("outer_kept_fraction", [None, 0.25], ids=["plain", "demo-outer"])
def test_diloco_through_the_manager_heals_a_late_replica_bit_identical(lighthouse, outer_kept_fraction):
    # Plain DiLoCo's outer mean calls FullReplicator.launch on the class: only the collectives hook reaches it.
    from lightning_hetero.replication import DiLoCoReplicator

    def replicator():
        extra = {} if outer_kept_fraction is None else {"outer_kept_fraction": outer_kept_fraction, "outer_chunk": 4}
        return DiLoCoReplicator(sync_every=2, **extra)

    started, on_first, on_late = _late_join_hooks()
    train = functools.partial(_demo_train, lighthouse, steps=8, replicator=replicator)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(train, "l0", 0, on_step=on_first)
        second = pool.submit(train, "l1", 1)
        assert started.wait(120)
        late = pool.submit(train, "l2", 2, on_step=on_late)
        results = [first.result(), second.result(), late.result()]
    for other in results[1:]:
        for mine, theirs in zip(other["params"], results[0]["params"], strict=True):
            assert torch.equal(mine, theirs)  # 8 steps end with an outer sync (sync_every=2)
    replicators = [r["opt"].replicator for r in results]
    assert {r.syncs for r in replicators} == {4}, [r.syncs for r in replicators]
    # Each replica trains on its own data: equal weights at the end only if the outer mean crossed the Manager.
    assert {n for ok, n, _, _ in results[0]["history"] if ok} == {2, 3}
