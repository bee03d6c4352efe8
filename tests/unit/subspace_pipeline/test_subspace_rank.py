"""SubspaceRankMonitor on a real (tiny) Trainer run: logged values equal a direct computation."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero.strategies.subspace_pipeline.callbacks import SubspaceRankMonitor, stable_rank
from lightning_hetero.subspace_pipeline import StageModule, SubspaceConfig, causal_lm_loss, constrained_model


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _tiny_llama() -> tf.LlamaForCausalLM:
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return tf.LlamaForCausalLM(config)


class _LM(LightningModule):
    def __init__(self, subspace: bool = False) -> None:
        super().__init__()
        hf = _tiny_llama()
        self.net = constrained_model(hf, SubspaceConfig(subspace_dim=8), 2) if subspace else hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(None, ids) if isinstance(self.net, StageModule) else self.net(ids).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return causal_lm_loss(self(ids), ids)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, 128, (16, 12), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=4)


def _fit(tmp_path: Path, module: LightningModule, monitor: SubspaceRankMonitor) -> Trainer:
    trainer = Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        callbacks=[monitor],
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return trainer


def test_stable_rank_values() -> None:
    assert stable_rank(torch.eye(5)) == pytest.approx(5.0)
    assert stable_rank(torch.outer(torch.arange(1.0, 4), torch.arange(1.0, 6))) == pytest.approx(1.0)
    assert stable_rank(torch.diag(torch.tensor([2.0, 1.0]))) == pytest.approx(1.25)
    assert stable_rank(torch.zeros(3, 3)) == 0.0


def test_logs_stable_rank_of_plain_model_equal_to_direct_computation(tmp_path: Path) -> None:
    module = _LM()
    trainer = _fit(tmp_path, module, SubspaceRankMonitor(every_n_steps=2))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("subspace/stable_rank/")}
    expected = {}
    for index in range(4):
        for path in (f"net.model.layers.{index}.self_attn.o_proj", f"net.model.layers.{index}.mlp.down_proj"):
            weight = module.get_submodule(path).weight.detach().double()
            svals = torch.linalg.svdvals(weight)
            expected[f"subspace/stable_rank/{path}"] = float((svals**2).sum() / svals[0] ** 2)
    expected["subspace/stable_rank/mean"] = sum(expected.values()) / len(expected)
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5), name
    rows = list(csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv")))
    logged_steps = sorted({int(r["step"]) for r in rows if r.get("subspace/stable_rank/mean")})
    assert logged_steps == [1, 3]  # every 2nd optimizer step, 0-based


def test_reparam_layers_report_the_dense_matrix_rank_and_pattern_filters(tmp_path: Path) -> None:
    module = _LM(subspace=True)
    trainer = _fit(
        tmp_path,
        module,
        SubspaceRankMonitor(every_n_steps=1, name_pattern=r"layers\.0\.(self_attn\.o_proj|mlp\.up_proj)$"),
    )
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("subspace/stable_rank/")}
    o_proj = module.net.model.layers["0"].self_attn.o_proj
    dense = o_proj.dense_weight().detach().double()  # U Z, d x in
    svals = torch.linalg.svdvals(dense)
    assert metrics["subspace/stable_rank/net.model.layers.0.self_attn.o_proj"] == pytest.approx(
        float((svals**2).sum() / svals[0] ** 2), rel=1e-5
    )
    assert metrics["subspace/stable_rank/net.model.layers.0.self_attn.o_proj"] <= 8 + 1e-6  # rank <= k
    assert "subspace/stable_rank/net.model.layers.0.mlp.up_proj" in metrics
    assert len(metrics) == 3  # two matrices + mean


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="every_n_steps=0"):
        SubspaceRankMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="not a valid regex"):
        SubspaceRankMonitor(name_pattern="(")
