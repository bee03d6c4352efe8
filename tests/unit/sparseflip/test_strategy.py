"""SparseFlipStrategy in one process: launch and setup errors, conversion, a real fit, registered names."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero import SparseFlipStrategy
from lightning_hetero.fabric import SparseFlipStrategy as FabricSparseFlipStrategy
from lightning_hetero.sparseflip import CodeExchangeSettings, FlipSettings, SparseFlipSettings, lowbit_layers


class DigitsMLP(L.LightningModule):
    """A user's module: a small MLP; its Linear layers become flip codes, the biases stay fp."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator)
    y = (x[:, :4].argmax(dim=1)).long()  # a learnable rule
    return DataLoader(TensorDataset(x, y), batch_size=16)


def test_server_outside_the_world_fails_before_launch():
    with pytest.raises(ValueError, match="SparseFlipSettings.exchange.server=3"):
        L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=SparseFlipStrategy(
                SparseFlipSettings(exchange=CodeExchangeSettings(server=3)), start_method="spawn"
            ),
        )


def test_more_flips_than_codes_fails_at_setup():
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SparseFlipStrategy(SparseFlipSettings(flip=FlipSettings(max_per_step=10**6))),
        max_steps=1,
        logger=False,
    )
    with pytest.raises(ValueError, match="flip.max_per_step=1000000, but the model has only 640 codes"):
        trainer.fit(DigitsMLP(), _loader())


class _Flips(Callback):
    def __init__(self) -> None:
        self.flips: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.flips.append(float(trainer.callback_metrics["lowbit/flips"]))


RULE_OPTIONS = {
    "local_bop": ({"bop_gamma": 0.3}, {}),  # the default rule: sign votes of the momenta past the threshold
    "bop": ({"bop_gamma": 0.3}, {"kept_fraction": 0.5, "encoding": "bf16"}),
    "topk": ({}, {"kept_fraction": 0.5, "encoding": "bf16"}),
}
"""Per rule: extra FlipSettings and CodeExchangeSettings fields."""


@pytest.mark.parametrize("rule", sorted(RULE_OPTIONS))
def test_single_process_fit_flips_codes_and_checkpoints_them(tmp_path, rule):
    flip, exchange_options = RULE_OPTIONS[rule]
    exchange = CodeExchangeSettings(**exchange_options)
    module = DigitsMLP()
    flips = _Flips()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SparseFlipStrategy(
            SparseFlipSettings(flip=FlipSettings(rule=rule, max_per_step=8, **flip), exchange=exchange)
        ),
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[flips],
    )
    trainer.fit(module, _loader())
    layers = lowbit_layers(module, mode="flip")
    assert [name for name, _ in layers] == ["net.0", "net.2"]
    assert not any(isinstance(m, nn.Linear) and type(m) is nn.Linear for m in module.modules())
    assert sum(flips.flips) > 0 and max(flips.flips) <= 8  # k caps the flips of either rule
    trainer.save_checkpoint(tmp_path / "flip.ckpt")
    state = torch.load(tmp_path / "flip.ckpt", weights_only=False)["state_dict"]
    assert state["net.0.codes"].dtype == torch.int8 and set(state["net.0.codes"].unique().tolist()) <= {-1, 0, 1}
    assert "net.0.weight" not in state  # no fp master copy


def test_fabric_refuses_an_optimizer_built_before_setup():
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricSparseFlipStrategy())
    fabric.launch()  # one process: runs in place
    model = DigitsMLP().net
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(RuntimeError, match="optimizer built before setup"):
        fabric.setup(model, optimizer)


def test_registered_names_resolve():
    assert isinstance(StrategyRegistry.get("sparseflip"), SparseFlipStrategy)
    assert StrategyRegistry.get("sparseflip_spawn")._start_method == "spawn"
    assert isinstance(Fabric(accelerator="cpu", devices=1, strategy="sparseflip").strategy, FabricSparseFlipStrategy)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_non_finite_code_gradients_raise_or_skip(policy):
    fabric = Fabric(
        accelerator="cpu", devices=1, strategy=FabricSparseFlipStrategy(SparseFlipSettings(on_nonfinite=policy))
    )
    fabric.launch()
    model = fabric.setup_module(DigitsMLP().net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    codes_before = model.module[0].codes.clone()
    x = torch.full((4, 16), float("nan"))
    loss = model(x).sum()
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="non-finite code gradient at step 0"):
            fabric.backward(loss)
        return
    with pytest.warns(RuntimeWarning, match="flips are skipped"):
        fabric.backward(loss)
    optimizer.step()
    assert fabric.strategy.last_metrics == {"lowbit/skipped_nonfinite": 1.0, "lowbit/flips": 0.0}
    assert torch.equal(model.module[0].codes, codes_before)
