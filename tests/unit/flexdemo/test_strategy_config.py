"""FlexDeMoStrategy in one process: argument errors, topology, block discovery, optimizer conversion, precision."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
)

from lightning_hetero.flexdemo.conversion import convert_optimizer, repoint_scheduler
from lightning_hetero.flexdemo.optim import DecoupledAdamW, DeMoSGD
from lightning_hetero.flexdemo.precision import check_precision, compute_dtype_for
from lightning_hetero.flexdemo.runtime import FlexDeMoRuntime
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.flexdemo.sharding import find_blocks, sharding_units
from lightning_hetero.flexdemo.topology import Topology, resolve_shard_size
from lightning_hetero.models.presets import build_config
from lightning_hetero.replication import ReplicationSettings, build_replicator
from lightning_hetero.strategies.flexdemo.fabric import FlexDeMoStrategy as FabricFlexDeMoStrategy
from lightning_hetero.strategies.flexdemo.trainer import FlexDeMoStrategy
from lightning_hetero.testing import run_distributed

STRATEGIES = [FlexDeMoStrategy, FabricFlexDeMoStrategy]


# ---------------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: ReplicationSettings(kind="nope"),
            r"ReplicationSettings.kind='nope': use one of \[None, 'demo', 'random', 'striding', 'diloco', 'full'",
        ),
        (
            lambda: ReplicationSettings(kept_fraction=0),
            r"ReplicationSettings.kept_fraction=0: use a fraction in \(0, 1\]",
        ),
        (lambda: ReplicationSettings(kept_fraction=1.5), r"ReplicationSettings.kept_fraction=1.5: use a fraction"),
        (lambda: ReplicationSettings(chunk=0), r"ReplicationSettings.chunk=0: use an int >= 1"),
        (lambda: FlexDeMoSettings(shard_size=0), r"FlexDeMoSettings.shard_size=0: use an int >= 1"),
        (lambda: FlexDeMoSettings(drift_check_every=-1), r"FlexDeMoSettings.drift_check_every=-1: use an int >= 0"),
        (
            lambda: FlexDeMoSettings(block_classes="LlamaDecoderLayer"),
            r"block_classes='LlamaDecoderLayer': give a list",
        ),
    ],
)
def test_bad_settings_fail_at_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()


_EXCHANGE = {"adamw_exchange": "preconditioned", "preconditioner_beta2": None}
"""``convert_optimizer``'s exchange arguments for the cases that do not test them (it has no defaults)."""


def test_shard_size_must_divide_ranks_per_node_before_launch():
    with pytest.raises(
        ValueError, match=r"settings.shard_size=3 must divide the 4 ranks per node.*Valid values: \[1, 2, 4\]"
    ):
        L.Trainer(
            accelerator="cpu",
            devices=4,
            strategy=FlexDeMoStrategy(settings=FlexDeMoSettings(shard_size=3)),
            logger=False,
        )
    with pytest.raises(ValueError, match=r"settings.shard_size=3 must divide the 2 ranks per node"):
        Fabric(
            accelerator="cpu",
            devices=2,
            num_nodes=2,
            strategy=FabricFlexDeMoStrategy(settings=FlexDeMoSettings(shard_size=3)),
        )


def test_resolve_shard_size_defaults_to_a_node():
    assert resolve_shard_size(None, 8, 4, "X") == 4
    assert resolve_shard_size(2, 8, 4, "X") == 2
    assert resolve_shard_size(1, 8, 4, "X") == 1


def test_topology_layout_is_replica_major():
    topology = Topology(world_size=8, rank=6, shard_size=4)
    assert (topology.num_replicas, topology.replica_index, topology.shard_index) == (2, 1, 2)
    assert topology.replicate_ranks == [2, 6]
    assert topology.shard_ranks == [4, 5, 6, 7]


def test_registered_names_resolve_in_both_registries():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_hetero

    assert isinstance(StrategyRegistry.get("flexdemo"), FlexDeMoStrategy)
    assert isinstance(STRATEGY_REGISTRY.get("flexdemo"), FabricFlexDeMoStrategy)
    assert StrategyRegistry.get("flexdemo_spawn")._start_method == "spawn"
    assert lightning_hetero.FlexDeMoStrategy is FlexDeMoStrategy
    from lightning_hetero.fabric import FlexDeMoStrategy as Exported

    assert Exported is FabricFlexDeMoStrategy


def test_precision_rules():
    check_precision("bf16-mixed")
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*GradScaler"):
        check_precision("16-mixed")
    assert compute_dtype_for("bf16-mixed") is torch.bfloat16
    assert compute_dtype_for("32-true") is None


# ---------------------------------------------------------------------------------------------------- blocks
@pytest.mark.parametrize(
    ("preset", "auto", "block", "count"),
    [
        ("llama-tiny", AutoModelForCausalLM, "LlamaDecoderLayer", 4),
        ("gpt2-tiny", AutoModelForCausalLM, "GPT2Block", 4),
        ("t5-tiny", AutoModelForSeq2SeqLM, "T5Block", 4),  # encoder and decoder stacks
        ("vit-tiny", AutoModelForImageClassification, "ViTLayer", None),
        ("bert-tiny", AutoModelForMaskedLM, "BertLayer", None),  # BERT has no _no_split_modules: ModuleList rule
    ],
)
def test_blocks_are_found_in_hf_models(preset, auto, block, count):
    model = auto.from_config(build_config(preset))
    wrapper = nn.Module()
    wrapper.model = model  # as inside a user's LightningModule
    blocks, source = find_blocks(wrapper)
    names = [type(b).__name__ for _, b in blocks]
    assert block in names
    if count is not None:
        assert names.count(block) == count
    assert source in ("_no_split_modules", "ModuleList")
    units = sharding_units(wrapper, blocks)
    assert units[-1].name == ""  # the root's remainder goes last
    covered = [id(p) for unit in units for p in unit.params]
    assert sorted(covered) == sorted({id(p) for p in wrapper.parameters()})  # every parameter exactly once


def test_block_classes_override_and_fallbacks():
    stack = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
    blocks, source = find_blocks(stack)
    assert source == "ModuleList" and len(blocks) == 3
    blocks, source = find_blocks(stack, ["Linear"])
    assert source == "block_classes" and len(blocks) == 4
    with pytest.raises(ValueError, match=r"block_classes=\['Missing'\] matches no module"):
        find_blocks(stack, ["Missing"])
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))[1] == "none"


# ---------------------------------------------------------------------------------------------------- optimizers
def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]


def test_adamw_becomes_decoupled_adamw_with_the_same_groups_and_scheduler():
    weight, bias = _params()
    adamw = torch.optim.AdamW(
        [{"params": [weight], "weight_decay": 0.1}, {"params": [bias], "weight_decay": 0.0, "lr": 5e-3}],
        lr=1e-2,
        betas=(0.8, 0.95),
        eps=1e-6,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5**step)
    converted, description = convert_optimizer(adamw, lambda: build_replicator("full"), **_EXCHANGE)
    assert isinstance(converted, DecoupledAdamW) and "AdamW converted to DecoupledAdamW" in description
    assert [g["params"] for g in converted.param_groups] == [[weight], [bias]]
    assert [g["weight_decay"] for g in converted.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in converted.param_groups] == [1e-2, 5e-3]
    assert [g["initial_lr"] for g in converted.param_groups] == [1e-2, 5e-3]
    assert converted.param_groups[0]["betas"] == (0.8, 0.95) and converted.param_groups[0]["eps"] == 1e-6
    assert converted.replicator.name == "full"
    assert repoint_scheduler(scheduler, adamw, converted)
    converted.bind(None)
    weight.grad, bias.grad = torch.ones_like(weight), torch.ones_like(bias)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        converted.step()
        scheduler.step()
    assert [g["lr"] for g in converted.param_groups] == [5e-3, 2.5e-3]


@pytest.mark.parametrize(
    ("replicator", "exchange", "beta2", "expected"),
    [
        ("demo", "preconditioned", 0.999, 0.999),  # the strategy's default: the long second-moment window
        ("demo", "preconditioned", None, 0.95),  # None keeps the user's
        ("demo", "direction", 0.999, 0.95),  # only the preconditioned exchange is overridden
        ("demo", "gradient", 0.999, 0.95),
        ("full", "preconditioned", 0.999, 0.95),  # Full runs the user's AdamW exactly
        ("diloco", "preconditioned", 0.999, 0.95),
    ],
)
def test_preconditioner_beta2_replaces_beta2_only_for_the_preconditioned_exchange(
    replicator, exchange, beta2, expected
):
    weight, bias = _params()
    adamw = torch.optim.AdamW(
        [{"params": [weight]}, {"params": [bias], "betas": (0.8, 0.9)}], lr=1e-2, betas=(0.9, 0.95)
    )
    converted, description = convert_optimizer(
        adamw, lambda: build_replicator(replicator), adamw_exchange=exchange, preconditioner_beta2=beta2
    )
    overridden = expected != 0.95
    assert converted.param_groups[0]["betas"] == (0.9, expected)
    assert converted.param_groups[1]["betas"] == (0.8, expected if overridden else 0.9)  # beta1 always kept
    assert ("beta2 0.9, 0.95 -> 0.999 (preconditioner_beta2)" in description) == overridden, description


def test_sgd_becomes_demo_sgd_and_keeps_momentum():
    sgd = torch.optim.SGD(_params(), lr=0.1, momentum=0.9, weight_decay=0.01)
    converted, _ = convert_optimizer(sgd, lambda: build_replicator("demo"), **_EXCHANGE)
    assert isinstance(converted, DeMoSGD)
    group = converted.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"], group["sign"]) == (0.1, 0.9, 0.01, True)
    plain, _ = convert_optimizer(torch.optim.SGD(_params(), lr=0.1), lambda: build_replicator("demo"), **_EXCHANGE)
    assert plain.param_groups[0]["momentum"] == 0.999  # SGD's 0 would drop the residual: DeMoSGD's default


def test_replicating_optimizer_is_kept_and_unsupported_ones_are_refused():
    own = DeMoSGD(_params(), lr=0.1, replicator="random")
    kept, description = convert_optimizer(own, lambda: build_replicator("demo"), **_EXCHANGE)
    assert kept is own and kept.replicator.name == "random" and "used as given" in description
    with pytest.raises(ValueError, match=r"cannot use the optimizer RMSprop: supported are torch.optim.AdamW"):
        convert_optimizer(torch.optim.RMSprop(_params()), lambda: None, **_EXCHANGE)
    with pytest.raises(ValueError, match=r"AdamW\(amsgrad=True\)"):
        convert_optimizer(torch.optim.AdamW(_params(), amsgrad=True), lambda: None, **_EXCHANGE)
    with pytest.raises(ValueError, match=r"SGD\(nesterov=True\)"):
        convert_optimizer(torch.optim.SGD(_params(), lr=0.1, momentum=0.9, nesterov=True), lambda: None, **_EXCHANGE)


# ---------------------------------------------------------------------------------------------------- runtime
def test_single_process_runtime_trains_and_warns_about_blocks_and_one_copy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    runtime = FlexDeMoRuntime(
        FlexDeMoSettings(replication=ReplicationSettings(kind="demo", kept_fraction=0.5, chunk=4))
    )
    with pytest.warns(UserWarning) as caught:
        runtime.setup_module(model, torch.device("cpu"))
    messages = " ".join(str(w.message) for w in caught)
    assert "no transformer blocks found" in messages and "single model copy" in messages
    optimizer = runtime.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
    losses = []
    for _ in range(30):
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        metrics = runtime.after_step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert metrics["comm/launched_early"] == 4 and metrics["comm/inter/bytes_sent_step"] == 0
    assert metrics["comm/encode_seconds"] > 0 and metrics["comm/decode_seconds"] > 0  # the DCT codec ran


def _one_copy_setup(runtime: FlexDeMoRuntime) -> tuple[list[str], torch.optim.Optimizer]:
    """Set up a small model alone (one model copy); the warnings raised and the converted optimizer."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.setup_module(model, torch.device("cpu"))
    optimizer = runtime.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95)))
    return [str(w.message) for w in caught], optimizer


@pytest.mark.parametrize("cls", STRATEGIES)
def test_one_copy_without_a_chosen_replicator_does_not_compress(cls):
    """Bare ``strategy: flexdemo`` on one node: nothing crosses nodes, so the default is the dense ``"full"``."""
    strategy = cls()
    messages, optimizer = _one_copy_setup(strategy.runtime)
    assert optimizer.replicator.name == "full"
    assert not any("single model copy" in message for message in messages), messages
    assert (
        "replicator='full'" in strategy.runtime.replicator_note and "no compression" in strategy.runtime.replicator_note
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "demo"},
        {"kept_fraction": 0.25},
        {"values": "sign"},
        {"kind": "random"},
    ],
)
def test_one_copy_keeps_an_explicit_compressing_choice_and_warns(kwargs):
    runtime = FlexDeMoRuntime(FlexDeMoSettings(replication=ReplicationSettings(**kwargs)))
    messages, optimizer = _one_copy_setup(runtime)
    assert optimizer.replicator.name == kwargs.get("kind", "demo")
    assert any("single model copy" in message for message in messages), messages
    assert runtime.replicator_note == ""
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)  # settings.preconditioner_beta2


def _default_replicator_worker(rank: int, world_size: int) -> dict[str, str]:
    names = {}
    for label, shard_size in (("two copies", 1), ("one copy", None)):
        runtime = FlexDeMoRuntime(FlexDeMoSettings(shard_size=shard_size))
        runtime.resolve_world(world_size, world_size)  # one node of world_size ranks
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no transformer blocks
            runtime.setup_module(model, torch.device("cpu"))
        names[label] = runtime.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2)).replicator.name
    return names


@pytest.mark.timeout(300)
def test_default_replicator_compresses_only_between_model_copies():
    """Two copies (``shard_size=1``) exchange DeMo updates by default; one copy of two shards does not compress."""
    results = run_distributed(_default_replicator_worker, 2, timeout=240)
    assert results == [{"two copies": "demo", "one copy": "full"}] * 2
