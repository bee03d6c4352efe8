"""FlexDeMoStrategy's fault-tolerant mode (settings.fault_tolerance) in a single-process Trainer on a real lighthouse.

One replica group in the pytest process (several replica groups that die and rejoin: tests/dist/test_ft_flexdemo.py).
Covers the settings field, the launch check (one launch per node, one model copy), the step gate (a step the
quorum does not commit leaves weights and optimizer state as they were) and the ft/* metrics.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero.core import WorldLayout
from lightning_hetero.flexdemo.runtime import FlexDeMoRuntime
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.replication import ReplicationSettings
from tests.fixtures import quiet_trainer

FT = FaultToleranceSettings(lighthouse="http://localhost:1", replica_id_source="fixed", replica_id="solo")


def test_fault_tolerance_takes_a_fault_tolerance_settings():
    assert FlexDeMoSettings().fault_tolerance is None
    assert FlexDeMoSettings(fault_tolerance=FT).fault_tolerance is FT
    with pytest.raises(ValueError, match=r"FlexDeMoSettings.fault_tolerance=.*FaultToleranceSettings"):
        FlexDeMoSettings(fault_tolerance={"lighthouse": "http://localhost:1"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("nodes", "ranks", "shard_size", "message"),
    [
        (2, 1, None, r"spans 2 nodes.*one job per node.*REPLICA_GROUP_ID"),
        (1, 4, 2, r"shard_size=2.*2 model copies.*shard_size=None"),
    ],
)
def test_the_launch_check_refuses_a_launch_spanning_nodes_or_holding_several_copies(nodes, ranks, shard_size, message):
    runtime = FlexDeMoRuntime(FlexDeMoSettings(fault_tolerance=FT, shard_size=shard_size))
    with pytest.raises(ValueError, match=message):
        runtime.resolve_launch(WorldLayout(nodes, ranks))
    FlexDeMoRuntime(FlexDeMoSettings(shard_size=shard_size)).resolve_launch(WorldLayout(nodes, ranks))  # restarts
    FlexDeMoRuntime(FlexDeMoSettings(fault_tolerance=FT)).resolve_launch(WorldLayout(1, 1))
    FlexDeMoRuntime(FlexDeMoSettings(fault_tolerance=FT)).resolve_launch(WorldLayout(1, 2))  # FSDP2 in the node


class _Regression(__import__("lightning").LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.logged: list[dict[str, float]] = []

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        return torch.nn.functional.mse_loss(self.net(inputs), target)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        metrics = self.trainer.callback_metrics
        self.logged.append({k: float(v) for k, v in metrics.items() if k.startswith("ft/")})
        runtime = self.trainer.strategy.runtime
        self.checkpoint_extra = runtime.extra_checkpoint_state(torch.device("cpu"))
        if batch_idx == 2:
            self.recovered = _recovery_round_trip(runtime.quorum.replica)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _recovery_round_trip(replica) -> dict:
    """What a joining replica would load from this one: its state through the recovery codec, checked against its own
    layout, loaded back (LR schedulers included)."""
    from lightning_hetero.ft.codec import decode_state, encode_state

    step = replica.current_step()
    blob = encode_state({"user": {"default": replica.state_dict()}, "torchft": replica.manager.state_dict()}, step)
    state = decode_state(blob, replica._receiver_layout(), peer=1, step=step)["user"]["default"]
    replica.load_state_dict(state)
    return state


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(64, 4, generator=generator)
    return DataLoader(TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin()), batch_size=16)


def _ft(lighthouse, min_replicas: int = 1, **extra) -> FaultToleranceSettings:
    return FaultToleranceSettings(
        lighthouse=lighthouse.address(),
        min_replicas=min_replicas,
        timeout_s=20,
        replica_id_source="fixed",
        replica_id="solo",
        **extra,
    )


@pytest.fixture
def lighthouse():
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    yield server
    server.shutdown()


def _trainer_strategy(ft: FaultToleranceSettings):
    from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy

    settings = FlexDeMoSettings(replication=ReplicationSettings(kind="demo", chunk=4), fault_tolerance=ft)
    return FlexDeMoStrategy(settings=settings)


@pytest.mark.timeout(180)
def test_a_committed_trainer_step_counts_in_global_step_and_travels_with_a_recovery(lighthouse):
    strategy = _trainer_strategy(_ft(lighthouse))
    module = _Regression()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=3)
    trainer.fit(module, _data())
    assert not strategy.runtime.quorum.active, "teardown leaves the quorum"
    assert strategy.runtime.replicator_name == "demo", "one rank per launch is not one model copy: no 'full' fallback"
    assert [m["ft/committed"] for m in module.logged] == [1.0] * 3
    assert [m["ft/retries"] for m in module.logged] == [0.0] * 3
    assert [m["ft/participants"] for m in module.logged] == [1.0] * 3
    assert [m["ft/step"] for m in module.logged] == [1.0, 2.0, 3.0]
    assert trainer.global_step == 3, "global_step counts committed steps"
    assert not all(torch.equal(p, q) for p, q in zip(module.parameters(), before, strict=True))
    assert strategy.optimizers[0].replicator.step == 3
    # A recovery carries the LR schedule (a joiner continues the survivors' schedule) and the Trainer's position.
    (scheduler,) = module.recovered["extra"]["lr_schedulers"]
    assert scheduler["last_epoch"] == 3 and scheduler["_last_lr"] == pytest.approx([0.05 * 0.5])
    assert strategy.lr_scheduler_configs[0].scheduler.last_epoch == 3
    # Taken at batch 2's end: 3 steps committed, the third batch of epoch 0 done (a live peer sends it from its
    # quorum, where the batch in flight is not done yet).
    assert module.recovered["extra"]["trainer_position"] == {
        "global_step": 3,
        "batches_that_stepped": 2,
        "epoch": 0,
        "batches": 2,
    }
    # Checkpoints carry torchft's committed step (the runtime's extra state).
    assert module.checkpoint_extra == {"torchft": {"step": 3, "batches_committed": 3}}


@pytest.mark.timeout(180)
def test_a_trainer_step_the_quorum_never_commits_is_retried_until_max_retries_then_raises(lighthouse):
    strategy = _trainer_strategy(_ft(lighthouse, min_replicas=2, max_retries=2))
    module = _Regression()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=3)
    with pytest.raises(RuntimeError, match=r"should_commit failed 3 times consecutively, exceeding max_retries=2"):
        trainer.fit(module, _data())
    # Three tries of the first batch, none committed: weights, optimizer state and every counter as before.
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before, strict=True))
    assert strategy.optimizers[0].replicator.step == 0
    assert trainer.global_step == 0
    assert strategy.lr_scheduler_configs[0].scheduler.last_epoch == 0


class _Indexed(_Regression):
    """Trains on (inputs, target, sample index) batches and records which data batch each step saw."""

    def __init__(self, fail_first_try_of: int | None = None) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, list[int]]] = []
        self.fail_first_try_of = fail_first_try_of

    def training_step(self, batch, batch_idx):
        inputs, target, index = batch
        self.seen.append((self.current_epoch, batch_idx, index.tolist()))
        if batch_idx == self.fail_first_try_of and [b for _, b, _ in self.seen].count(batch_idx) == 1:
            # A peer failing mid-step looks like this to the Manager: the step may not commit.
            self.trainer.strategy.runtime.quorum.replica.manager.report_error(RuntimeError("injected failure"))
        return torch.nn.functional.mse_loss(self.net(inputs), target)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        metrics = self.trainer.callback_metrics
        self.logged.append({k: float(v) for k, v in metrics.items() if k.startswith("ft/")})


def _indexed(stateful: bool = True) -> DataLoader:
    """24 samples in batches of 4; stateful: shuffled per epoch (``randperm(24)`` seeded by ``epoch``)."""
    from lightning_hetero.data.stateful import StatefulDataLoader

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(24, 4, generator=generator)
    dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin(), torch.arange(24))
    return StatefulDataLoader(dataset, batch_size=4, shuffle=True) if stateful else DataLoader(dataset, batch_size=4)


def _batch(epoch: int, index: int) -> list[int]:
    """Samples of batch ``index`` of ``epoch`` in :func:`_indexed`'s stateful loader."""
    return torch.randperm(24, generator=torch.Generator().manual_seed(epoch)).tolist()[4 * index : 4 * index + 4]


@pytest.mark.timeout(180)
def test_a_discarded_trainer_step_is_retried_with_the_same_batch_and_does_not_count(lighthouse):
    strategy = _trainer_strategy(_ft(lighthouse))
    module = _Indexed(fail_first_try_of=1)
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=3, use_distributed_sampler=False)
    trainer.fit(module, _indexed())
    expected = [_batch(0, 0), _batch(0, 1), _batch(0, 1), _batch(0, 2)]
    assert [data for _, _, data in module.seen] == expected, "batch 1 ran twice: discarded, then committed"
    assert [m["ft/retries"] for m in module.logged] == [0.0, 1.0, 0.0]
    assert [m["ft/step"] for m in module.logged] == [1.0, 2.0, 3.0]
    assert trainer.global_step == 3 and strategy.lr_scheduler_configs[0].scheduler.last_epoch == 3


class _Heal(__import__("lightning").Callback):
    """Loads a live peer's state at the first quorum (or before batch ``at_batch``), as torchft does for a joining
    (or lagging) replica, through the codec."""

    def __init__(self, position: dict[str, int], at_batch: int | None = None) -> None:
        self.position = position
        self.at_batch = at_batch

    def on_train_start(self, trainer, module):
        if self.at_batch is None:
            self._heal(trainer)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx != self.at_batch:
            return
        # Healed in place by this batch's quorum (the strategy's hook, after this one), to the peer's later step.
        replica = trainer.strategy.runtime.quorum.replica
        join = replica.start_step

        def join_and_heal():
            join()
            replica.start_step = join
            self._heal(trainer)
            manager = replica.manager
            manager.load_state_dict({**manager.state_dict(), "step": self.position["global_step"]})

        replica.start_step = join_and_heal

    def _heal(self, trainer):
        from lightning_hetero.ft.codec import decode_state, encode_state

        replica = trainer.strategy.runtime.quorum.replica
        peer = replica.state_dict()
        peer["extra"]["trainer_position"] = dict(self.position)
        step = replica.current_step()
        blob = encode_state({"user": {"default": peer}, "torchft": replica.manager.state_dict()}, step)
        replica.load_state_dict(decode_state(blob, replica._receiver_layout(), peer=1, step=step)["user"]["default"])


PEER = {"global_step": 5, "batches_that_stepped": 5, "epoch": 1, "batches": 2}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("distributed_sampler", [False, True], ids=["own-sampler", "lightning-distributed-sampler"])
def test_a_healed_trainer_takes_the_peers_global_step_and_its_data_position_on_its_own_stream(
    lighthouse, distributed_sampler
):
    # Lightning's DistributedSampler (one replica, seed 0) draws the same per-epoch order as the loader's own sampler.
    strategy = _trainer_strategy(_ft(lighthouse))
    module = _Indexed()
    trainer = quiet_trainer(
        devices=1,
        strategy=strategy,
        max_steps=11,
        callbacks=[_Heal(PEER)],
        use_distributed_sampler=distributed_sampler,
    )
    trainer.fit(module, _indexed())
    # Epoch 1 (its own shuffle) from its third batch to its end, then epoch 2 from the start; stopped by max_steps
    # at the peer's count (5 + 6 steps).
    rest_of_epoch_1 = [(1, index, _batch(1, index)) for index in range(2, 6)]
    assert module.seen == [*rest_of_epoch_1, (2, 0, _batch(2, 0)), (2, 1, _batch(2, 1))]
    assert trainer.global_step == 11
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 11  # the loggers' step axis lines up too


@pytest.mark.timeout(180)
def test_a_trainer_healed_in_place_mid_epoch_takes_the_peers_step_and_its_data_position(lighthouse, caplog):
    strategy = _trainer_strategy(_ft(lighthouse))
    module = _Indexed()
    peer = {"global_step": 7, "batches_that_stepped": 7, "epoch": 0, "batches": 4}
    heal = _Heal(peer, at_batch=1)
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=9, callbacks=[heal], use_distributed_sampler=False)
    with caplog.at_level("INFO", logger="lightning_hetero"):
        trainer.fit(module, _indexed())
    # Batch 1 (in flight at the heal) was drawn for step 2, which the quorum committed without this node: it is
    # dropped (its forward runs once for Lightning's closure; nothing is stepped). The position jumps to the peer's:
    # batch 4 (the peer's next) commits as step 8, batch 5 as step 9. Batches 1-3 are the steps this node missed.
    assert module.seen == [(0, 0, _batch(0, 0)), (0, 1, _batch(0, 1)), (0, 4, _batch(0, 4)), (0, 5, _batch(0, 5))]
    assert trainer.global_step == 9 and trainer.fit_loop.epoch_loop._batches_that_stepped == 9
    assert [m["ft/committed"] for m in module.logged] == [1.0, 0.0, 1.0, 1.0]
    assert [m["ft/abandoned_batches"] for m in module.logged] == [0.0, 1.0, 1.0, 1.0]
    notes = [r.getMessage() for r in caplog.records if "mid-epoch" in r.getMessage()]
    assert len(notes) == 1 and "moves 2 batch(es) forward, to the peer's (epoch 0, next batch 4)" in notes[0], notes


@pytest.mark.timeout(180)
def test_with_a_plain_dataloader_only_the_step_follows_and_that_is_logged_once(lighthouse, caplog):
    strategy = _trainer_strategy(_ft(lighthouse))
    module = _Indexed()
    trainer = quiet_trainer(
        devices=1, strategy=strategy, max_steps=8, callbacks=[_Heal(PEER)], use_distributed_sampler=False
    )
    with caplog.at_level("INFO", logger="lightning_hetero"):
        trainer.fit(module, _indexed(stateful=False))
    assert module.seen == [(0, 0, [0, 1, 2, 3]), (0, 1, [4, 5, 6, 7]), (0, 2, [8, 9, 10, 11])]
    assert trainer.global_step == 8
    notes = [r.getMessage() for r in caplog.records if "data position" in r.getMessage()]
    assert len(notes) == 1 and "StatefulDataLoader" in notes[0], notes


@pytest.mark.timeout(180)
def test_a_peer_position_that_is_negative_is_refused_naming_the_field(lighthouse):
    from lightning_hetero.comm.validation import PeerPayloadError

    strategy = _trainer_strategy(_ft(lighthouse))
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=2, callbacks=[_Heal({**PEER, "batches": -1})])
    with pytest.raises(PeerPayloadError, match=r"trainer_position.batches") as caught:
        trainer.fit(_Indexed(), _indexed())
    assert caught.value.field == "extra.trainer_position.batches"


def test_a_trainer_or_fabric_spanning_nodes_is_refused_before_launch():
    from lightning.fabric import Fabric

    from lightning_hetero.strategies.flexdemo.fabric import FlexDeMoStrategy as FabricFlexDeMoStrategy
    from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy

    settings = FlexDeMoSettings(fault_tolerance=FT)
    with pytest.raises(ValueError, match=r"spans 2 nodes.*one job per node"):
        quiet_trainer(devices=1, num_nodes=2, strategy=FlexDeMoStrategy(settings=settings))
    with pytest.raises(ValueError, match=r"spans 2 nodes.*one job per node"):
        Fabric(accelerator="cpu", devices=1, num_nodes=2, strategy=FabricFlexDeMoStrategy(settings=settings))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("min_replicas", [1, 2], ids=["commits", "too-few-replicas"])
def test_a_fabric_step_is_kept_only_when_the_quorum_commits_it(min_replicas):
    pytest.importorskip("torchft")
    from lightning.fabric import Fabric
    from torchft.coordination import LighthouseServer

    from lightning_hetero.strategies.flexdemo.fabric import FlexDeMoStrategy

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    try:
        ft = FaultToleranceSettings(
            lighthouse=lighthouse.address(),
            min_replicas=min_replicas,
            timeout_s=20,
            replica_id_source="fixed",
            replica_id="solo",
        )
        settings = FlexDeMoSettings(replication=ReplicationSettings(kind="demo", chunk=4), fault_tolerance=ft)
        strategy = FlexDeMoStrategy(settings=settings)
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        fabric.launch()
        module = _Regression()
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
        before = [p.detach().clone() for p in model.parameters()]
        metrics = []
        for inputs, target in list(_data())[:3]:
            strategy.start_step()
            fabric.backward(torch.nn.functional.mse_loss(model.net(inputs), target))
            optimizer.step()
            optimizer.zero_grad()
            metrics.append(dict(strategy.last_comm_metrics))
        replicator_step = optimizer.replicator.step
        committed_steps = strategy.committed_steps
        fabric.strategy.teardown()
    finally:
        lighthouse.shutdown()
    assert not strategy.runtime.quorum.active, "teardown leaves the quorum"
    committed = min_replicas == 1
    assert strategy.last_commit is None or strategy.last_commit is committed
    assert [m["ft/committed"] for m in metrics] == [float(committed)] * 3
    assert [m["ft/step"] for m in metrics] == ([1.0, 2.0, 3.0] if committed else [0.0] * 3)
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert unchanged is not committed
    assert replicator_step == (3 if committed else 0)
    assert committed_steps == (3 if committed else 0)  # what a Fabric loop indexes its data and stops by
    assert [m["ft/retries"] for m in metrics] == [0.0] * 3  # Fabric does not retry: the user's loop decides


def test_the_spot_config_parses_into_fault_tolerance_settings(tmp_path, monkeypatch):
    from pathlib import Path

    from lightning_hetero.cli import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    config = Path(__file__).resolve().parents[3] / "configs" / "flexdemo_spot.yaml"
    override = ["--trainer.strategy.init_args.settings.fault_tolerance.min_replicas", "3"]
    cli = build_cli(["--config", str(config), *override], run=False)
    ft = cli.trainer.strategy.settings.fault_tolerance
    assert isinstance(ft, FaultToleranceSettings)
    assert (ft.min_replicas, ft.timeout_s, ft.replica_id_source, ft.lighthouse) == (3, 30.0, "env", "")
    assert cli.trainer.strategy.settings.replication.kind == "demo"
