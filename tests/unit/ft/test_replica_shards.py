"""A replica whose model is FSDP2-sharded (DTensor parameters) sends its local shards and heals them in place.

One process (a one-rank gloo group, a live lighthouse): the recovery state holds plain local tensors, the codec checks
them against the receiver's local shapes, and loading writes into the DTensor parameters' local shards (they stay
DTensors, and training goes on). Several ranks per replica group, killed and rejoined:
tests/dist/test_ft_replica_groups.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchft")
pytest.importorskip("safetensors")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

from lightning_hetero.flexdemo.optim import DeMoSGD  # noqa: E402
from lightning_hetero.ft.codec import decode_state, encode_state  # noqa: E402
from lightning_hetero.ft.replicas import FaultTolerantReplica  # noqa: E402
from lightning_hetero.ft.settings import FaultToleranceSettings  # noqa: E402


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    yield server.address()
    server.shutdown()


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_fsdp2_local_shards_travel_through_the_recovery_codec_and_load_in_place(lighthouse, one_rank_group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fully_shard(model, mesh=one_rank_group)
    optimizer = DeMoSGD(model.parameters(), lr=0.05, replicator="demo", kept_fraction=0.25, chunk=4)
    optimizer.bind(None)
    settings = FaultToleranceSettings(lighthouse=lighthouse, replica_id_source="fixed", replica_id="shards")
    replica = FaultTolerantReplica(settings, model=model, optimizer=optimizer, store_host="localhost")
    replica.manage(optimizer.replicator)

    def step() -> None:
        replica.start_step()
        model(torch.randn(3, 4)).square().mean().backward()
        assert replica.step_optimizer()
        optimizer.zero_grad()

    try:
        for _ in range(2):
            step()
        own = replica.state_dict()
        assert own["model"] and all(type(value) is torch.Tensor for value in own["model"].values())  # no DTensor
        at = replica.current_step()
        blob = encode_state({"user": {"default": own}, "torchft": replica.manager.state_dict()}, at)
        state = decode_state(blob, replica._receiver_layout(), peer=1, step=at)["user"]["default"]
        expected = [param.to_local().clone() for param in model.parameters()]
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        replica.load_state_dict(state)
        for param, want in zip(model.parameters(), expected, strict=True):
            assert isinstance(param, DTensor) and torch.equal(param.to_local(), want)
        step()  # FSDP2 still trains on the loaded shards
    finally:
        replica.shutdown()
