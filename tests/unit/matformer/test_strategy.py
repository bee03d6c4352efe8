"""MatFormerStrategy (Trainer and Fabric) without processes: settings, world expansion, registration, CLI parsing,
the sync/skip logic, masks, and the checkpoint slicing helpers. Milliseconds each, except the Trainer/CLI builds."""

from __future__ import annotations

import copy
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_hetero
from lightning_hetero import MatFormerStrategy
from lightning_hetero.fabric import MatFormerStrategy as FabricMatFormerStrategy
from lightning_hetero.matformer import (
    HelperConfig,
    MatFormerRuntime,
    UnsupportedModelError,
    find_ffns,
    grow_to_full,
    slice_model,
    slice_model_state,
    slice_optimizer_state,
    tier_view,
    widths_for,
)
from lightning_hetero.matformer.settings import MatFormerSettings
from lightning_hetero.replication.settings import ReplicationSettings

STRATEGIES = [MatFormerStrategy, FabricMatFormerStrategy]


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(config)


# ---------------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("cls", STRATEGIES)
def test_demo_settings_reach_the_runtime(cls):
    replication = ReplicationSettings(kept_fraction=0.25, chunk=16, values="bf16")
    strategy = cls(settings=MatFormerSettings(tiers=[0, 1], mode="demo", replication=replication))
    assert strategy.settings is strategy.runtime.settings
    assert strategy.settings.mode == "demo" and strategy.settings.replication == replication
    assert cls(settings=MatFormerSettings(mode="demo")).runtime.exchange is None  # built at setup, on the groups


def _trainer(strategy: MatFormerStrategy, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", strategy=strategy, logger=False, enable_progress_bar=False, **kwargs)


def test_tiers_length_is_checked_against_the_world_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"3 entries, but the run has 2 ranks.*one entry per global rank \(2\)"):
        _trainer(MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1, 2])), devices=2)
    with pytest.raises(ValueError, match=r"run has 4 ranks \(2 node\(s\) x 2 devices\).*one per node \(2\)"):
        _trainer(MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1, 1])), devices=2, num_nodes=2)


def test_per_node_tiers_expand_to_every_rank_of_the_node():
    strategy = MatFormerStrategy(settings=MatFormerSettings(tiers=[0, [1, 2]]))
    _trainer(strategy, devices=3, num_nodes=2)
    assert strategy.tiers == [0, 0, 0, [1, 2], [1, 2], [1, 2]]
    assert strategy.tier == 0  # this process is global rank 0
    per_rank = MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1, 2, 2]))
    _trainer(per_rank, devices=2, num_nodes=2)
    assert per_rank.tiers == [0, 1, 2, 2]
    default = MatFormerStrategy()  # no settings: every rank tier 0
    _trainer(default, devices=2)
    assert default.tiers == [0, 0]
    runtime = MatFormerRuntime(MatFormerSettings(tiers=[0, 1, 2]))
    assert [runtime.tier_of(r) for r in range(3)] == [None] * 3  # unknown before the world is resolved
    runtime.resolve_world(6, num_nodes=3)
    assert runtime.per_rank == [0, 0, 1, 1, 2, 2] and runtime.tier_of(3) == 1


def test_fabric_checks_the_world_when_fabric_is_built():
    with pytest.raises(ValueError, match="one entry per global rank"):
        Fabric(
            accelerator="cpu", devices=2, strategy=FabricMatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1, 1]))
        )
    strategy = FabricMatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1]))
    Fabric(accelerator="cpu", devices=2, strategy=strategy)
    assert strategy.runtime.per_rank == [0, 1] and strategy.tier == 0


# ---------------------------------------------------------------------------------------------------- registration
def test_registered_in_both_registries():
    assert StrategyRegistry["matformer"]["strategy"].resolve() is MatFormerStrategy
    assert FABRIC_REGISTRY["matformer"]["strategy"].resolve() is FabricMatFormerStrategy
    assert StrategyRegistry["matformer_spawn"]["init_params"] == {"start_method": "spawn"}
    assert FABRIC_REGISTRY["matformer_spawn"]["init_params"] == {"start_method": "spawn"}
    assert lightning_hetero.MatFormerStrategy is MatFormerStrategy
    trainer = _trainer("matformer_spawn", devices=2)
    assert isinstance(trainer.strategy, MatFormerStrategy) and trainer.strategy._start_method == "spawn"
    assert trainer.strategy.tiers == [0, 0]
    fabric = Fabric(accelerator="cpu", devices=2, strategy="matformer")
    assert isinstance(fabric.strategy, FabricMatFormerStrategy)


def test_cli_parses_the_strategy_from_yaml(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  strategy:\n"
        "    class_path: lightning_hetero.MatFormerStrategy\n    init_args:\n      settings:\n"
        "        tiers: [0, [1, 0]]\n"
        "        mode: sign\n        tier_weights: [1.0, 2.0]\n        slice_weights: false\n"
        "        helper_fraction: 0.25\n"
    )
    cli = LightningCLI(BoringModel, BoringDataModule, args=["--config", str(config)], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MatFormerStrategy)
    assert strategy.tiers == [0, [1, 0]]
    settings = strategy.settings
    assert (settings.mode, settings.tier_weights, settings.slice_weights, settings.helper_fraction) == (
        "sign",
        [1.0, 2.0],
        False,
        0.25,
    )


# ---------------------------------------------------------------------------------------------------- setup errors
def test_unknown_architecture_fails_with_the_adapter_error():
    runtime = MatFormerRuntime(MatFormerSettings())
    with pytest.raises(UnsupportedModelError, match="register_adapter"):
        runtime.setup(nn.Sequential(nn.Linear(4, 4)), torch.device("cpu"), lambda: 0)


def test_per_layer_entries_must_match_the_number_of_ffns():
    runtime = MatFormerRuntime(MatFormerSettings(tiers=[[0, 0, 0]]))
    with pytest.raises(
        ValueError, match=r"settings.tiers=\[\[0, 0, 0\]\] does not fit the model's 2 FFNs.*one value per FFN"
    ):
        runtime.setup(_llama(), torch.device("cpu"), lambda: 0)


def test_rank0_must_be_full_width_with_widths():
    runtime = MatFormerRuntime(MatFormerSettings(widths=[16]))
    with pytest.raises(ValueError, match="global rank 0 must train the full width"):
        runtime.setup(_llama(), torch.device("cpu"), lambda: 0)


def test_world_of_one_is_plain_training():
    runtime = MatFormerRuntime(MatFormerSettings())
    model = _llama()
    runtime.setup(model, torch.device("cpu"), lambda: 0)
    assert runtime.layout == widths_for([0], 32) and not runtime.sliced and not runtime.heterogeneous
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    runtime.sync_gradients(model, step=0)
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    reference = copy.deepcopy(model)
    for param, copied in zip(model.parameters(), reference.parameters(), strict=True):
        copied.grad = param.grad.clone()
    norm = runtime.clip_grad_norm_(model.parameters(), 0.01)
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


# ---------------------------------------------------------------------------------------------------- sync and skip
def test_trainer_post_backward_syncs_unless_accumulating():
    strategy = MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1]))
    module = mock.Mock(trainer=mock.Mock(global_step=3), _trainer=object())
    strategy._lightning_module = module
    strategy.runtime.sync_gradients = mock.Mock()
    with strategy.block_backward_sync():
        strategy.post_backward(torch.tensor(1.0))
    strategy.runtime.sync_gradients.assert_not_called()
    strategy.post_backward(torch.tensor(1.0))
    strategy.runtime.sync_gradients.assert_called_once_with(module, 3)


def test_fabric_backward_syncs_unless_no_backward_sync():
    strategy = FabricMatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1]))
    strategy.precision = FabricPrecision()
    strategy._module = nn.Linear(2, 1)
    strategy.runtime.sync_gradients = mock.Mock()
    loss = strategy._module(torch.ones(1, 2)).sum()
    with strategy._backward_sync_control.no_backward_sync(strategy._module, enabled=True):
        strategy.backward(loss, None, retain_graph=True)
    strategy.runtime.sync_gradients.assert_not_called()
    strategy.backward(loss, None)
    strategy.runtime.sync_gradients.assert_called_once_with(strategy._module, 0)
    assert strategy.step == 1


def test_fabric_setup_repoints_the_optimizer_at_the_sliced_parameters():
    strategy = FabricMatFormerStrategy(
        settings=MatFormerSettings(tiers=[0, 1]), parallel_devices=[torch.device("cpu")] * 2
    )
    # Simulate a tier-1 rank: the collective setup is replaced by the slicing it ends with.
    strategy.runtime.setup = lambda module, device, step_fn: slice_model(module, tier=1)
    model = _llama()
    optimizer = torch.optim.AdamW(model.parameters())
    model, (optimizer,), _ = strategy.setup_module_and_optimizers(model, [optimizer])
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert find_ffns(model)[0].width == 16
    stale = FabricMatFormerStrategy(
        settings=MatFormerSettings(tiers=[0, 1]), parallel_devices=[torch.device("cpu")] * 2
    )
    stale.runtime.setup = lambda module, device, step_fn: slice_model(module, tier=1)
    model = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(input_ids=torch.tensor([[1, 2]]), labels=torch.tensor([[1, 2]])).loss.backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="setup_module"):
        stale.setup_module_and_optimizers(model, [optimizer])


# ---------------------------------------------------------------------------------------------------- masks
def _masked_runtime(model: nn.Module, helper_fraction: float = 0.0) -> MatFormerRuntime:
    """A runtime as rank 1 of tiers [0, 1] with full weights (slice_weights=False), without a process group."""
    settings = MatFormerSettings(
        tiers=[0, 1], slice_weights=False, helper_fraction=helper_fraction, helper_redraw_every=2, helper_seed=3
    )
    runtime = MatFormerRuntime(settings)
    runtime.rank, runtime.layout = 1, widths_for([0, 1], 32)
    runtime.helpers = runtime._build_helpers(runtime.layout)
    runtime.blocks = find_ffns(model)
    runtime.local_widths = [16, 16]
    runtime._install_masks(model)
    return runtime


def test_masks_train_exactly_the_tier_and_evaluate_the_tier():
    model, reference = _llama(), _llama()
    runtime = _masked_runtime(model)
    batch = {"input_ids": torch.tensor([[1, 5, 7, 2]]), "labels": torch.tensor([[1, 5, 7, 2]])}
    loss = model(**batch).loss
    with tier_view(reference, tier=1):
        expected = reference(**batch).loss
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    loss.backward()
    for block in runtime.blocks:
        for spec in block.parameters:
            grad = dict(model.named_parameters())[spec.name].grad
            assert grad.narrow(spec.axis, 16, 16).count_nonzero() == 0
            assert grad.narrow(spec.axis, 0, 16).count_nonzero() > 0
    runtime.remove_masks()
    assert not torch.allclose(model(**batch).loss, expected)


def test_helper_masks_add_the_drawn_neurons_and_redraw():
    model = _llama()
    step = [0]
    runtime = _masked_runtime(model, helper_fraction=0.5)
    assert runtime.helpers == {1: HelperConfig(0.5, seed=3, redraw_every=2)}
    runtime.step_fn = lambda: step[0]
    seen = []
    down = model.get_submodule(runtime.blocks[0].projections[-1].path)
    down.register_forward_hook(lambda module, args, out: seen.append(args[0][0, 0].ne(0).nonzero().flatten()))
    batch = {"input_ids": torch.tensor([[1, 5, 7]])}
    for current in (0, 1, 2):
        step[0] = current
        model(**batch)
    assert len(seen[0]) == 24 and torch.equal(seen[0], seen[1])  # prefix 16 + 8 drawn, fixed within a window
    assert not torch.equal(seen[0], seen[2]) and torch.equal(seen[2][:16], torch.arange(16))
    model.eval()
    model(**batch)
    assert torch.equal(seen[-1], torch.arange(16))  # evaluation runs the tier itself


# ---------------------------------------------------------------------------------------------------- checkpoints
def test_sliced_state_matches_training_the_slice():
    full = _llama()
    optimizer = torch.optim.AdamW(full.parameters(), lr=0.1)
    batch = {"input_ids": torch.tensor([[1, 5, 7, 2]]), "labels": torch.tensor([[1, 5, 7, 2]])}
    with tier_view(full, tier=1):
        full(**batch).loss.backward()
    optimizer.step()
    ffn_params = [p for block in find_ffns(full) for p in block.parameters]
    sliced = slice_model(copy.deepcopy(_llama()), tier=1)
    sliced.load_state_dict(slice_model_state(full.state_dict(), ffn_params, [16, 16]))
    sliced_optimizer = torch.optim.AdamW(sliced.parameters(), lr=0.1)
    state = slice_optimizer_state(optimizer.state_dict(), sliced_optimizer, sliced, ffn_params)
    sliced_optimizer.load_state_dict(state)
    names = dict(full.named_parameters())
    specs = {p.name: p for p in ffn_params}
    for (name, param), (index, moments) in zip(
        sliced.named_parameters(), sliced_optimizer.state_dict()["state"].items(), strict=True
    ):
        expected = names[name].narrow(specs[name].axis, 0, 16) if name in specs else names[name]
        assert torch.equal(param, expected), name
        assert moments["exp_avg"].shape == param.shape, (index, name)
    # Loading a rank's own (already sliced) state is accepted as is.
    assert slice_model_state(sliced.state_dict(), ffn_params, [16, 16]).keys() == sliced.state_dict().keys()
    with pytest.raises(ValueError, match="same configure_optimizers"):
        slice_optimizer_state(optimizer.state_dict(), torch.optim.AdamW([nn.Parameter(torch.ones(1))]), sliced, [])


def test_grow_to_full_restores_shapes_and_config():
    model = slice_model(_llama(), tier=1)
    blocks = find_ffns(_llama())
    prefix = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    grown = grow_to_full(model, blocks)
    assert len(grown) == 6 and model.config.intermediate_size == 32
    assert not hasattr(model.config, "matformer_tier")
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.shape == (16, 32) and down.in_features == 32
    assert torch.equal(down.weight[:, :16], prefix) and down.weight[:, 16:].count_nonzero() == 0
    assert all(block.width == 32 for block in find_ffns(model))
    model(input_ids=torch.tensor([[1, 2]]))
