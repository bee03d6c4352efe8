"""SubspacePipelineStrategy on spawned CPU ranks (gloo): Trainer and Fabric fits of a tiny Llama, 2 stages.

Every fit spawns its own ranks (``start_method="spawn"``: the popen launcher would re-run pytest). Each rank writes
what the assertions need (losses, logged metrics, stage parameters, optimizer state) to ``tmp_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero.models import CausalLMModule
from lightning_hetero.strategies.subspace_pipeline.fabric import (
    SubspacePipelineStrategy as FabricSubspacePipelineStrategy,
)
from lightning_hetero.strategies.subspace_pipeline.trainer import SubspacePipelineStrategy
from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings
from tests.fixtures import StrategyStepLlama, ValidatedTokenData, fit_ranks, pipeline_fields
from tests.token_data import TINY_LLAMA, progressions

CLIP = 0.5


def _data() -> ValidatedTokenData:
    """One batch of 4 sequences per epoch, the same every epoch (resume then depends only on the restored state)."""
    return ValidatedTokenData(4, batch_size=4)


def _fit(
    out: Path,
    module: L.LightningModule,
    strategy: Any,
    max_steps: int,
    checkpoint: Path | None = None,
    ckpt_path: Path | None = None,
    validate: bool = False,
) -> list[dict[str, Any]]:
    """Each rank records its stage, losses, logged ``train/loss``, metrics, parameters and optimizer state."""
    return fit_ranks(
        out,
        module,
        _data(),
        strategy,
        max_steps,
        checkpoint,
        ckpt_path,
        recorder={"fields": pipeline_fields, "series": {"logged": ("train/loss", None)}},
        gradient_clip_val=CLIP,
        limit_val_batches=1 if validate else 0,
        check_val_every_n_epoch=max_steps if validate else 1,
        num_sanity_val_steps=0,
    )


def _strategy(**settings: Any) -> SubspacePipelineStrategy:
    """2 stages, k = 8, 2 micro-batches, plus ``settings`` (fields of :class:`SubspacePipelineSettings`)."""
    options = {"subspace_dim": 8, "n_microbatches": 2, **settings}
    return SubspacePipelineStrategy(settings=SubspacePipelineSettings(**options), start_method="spawn")


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """8 uninterrupted steps of the user's own module, with clipping (active: the norms exceed 0.5) and validation."""
    out = tmp_path_factory.mktemp("trainer")
    return _fit(out, StrategyStepLlama(), _strategy(), max_steps=8, validate=True)


@pytest.mark.timeout(180)
def test_trainer_loss_falls_and_every_rank_logs_the_real_loss(trainer_run):
    stage0, stage1 = trainer_run
    assert (stage0["stage"], stage1["stage"]) == (0, 1)
    assert stage0["losses"] == stage1["losses"]  # broadcast from the last stage
    assert stage0["logged"] == stage0["losses"]  # train/loss is the real loss, not a placeholder
    losses = stage0["losses"]
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < losses[0] - 0.3, losses
    assert stage0["metrics"]["val/loss"] == stage1["metrics"]["val/loss"] < losses[0]
    # each rank holds only its stage: the embedding on stage 0, the head on stage 1
    assert any("embed_tokens" in k for k in stage0["state"]) and not any("lm_head" in k for k in stage0["state"])
    assert any("lm_head" in k for k in stage1["state"]) and not any("embed_tokens" in k for k in stage1["state"])
    assert stage0["pipeline_bytes"] > 0
    # The same 8 steps in one process (the whole constrained model, AdamW, clipping at the global norm): equal losses.
    # A zero_grad trap or stale gradients (the schedule runs before Lightning's zero_grad) would break this.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_one_process_losses(8)), rtol=0, atol=1e-4)


def _one_process_losses(steps: int) -> list[float]:
    from lightning_hetero.subspace_pipeline.basis import SubspaceConfig
    from lightning_hetero.subspace_pipeline.stages import causal_lm_loss, constrained_model

    model = constrained_model(StrategyStepLlama().model, SubspaceConfig(subspace_dim=8), 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    batch = next(iter(_data().train_dataloader()))
    losses = []
    for _ in range(steps):
        loss = causal_lm_loss(model(None, batch["input_ids"]), batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_trainer_resume_is_bit_identical_on_every_stage(tmp_path):
    """Subspace updates every 3 steps, checkpoint at step 4 (mid-interval: the statistic is part of the state)."""
    checkpoint = tmp_path / "step4.ckpt"
    straight = _fit(tmp_path / "straight", StrategyStepLlama(), _strategy(update_every=3), 8, validate=True)
    _fit(tmp_path / "first", StrategyStepLlama(), _strategy(update_every=3), 4, checkpoint=checkpoint)
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "meta.json",
        "stage_0.pt",
        "stage_0.pt.sha256",
        "stage_1.pt",
        "stage_1.pt.sha256",
    ]
    resumed = _fit(
        tmp_path / "resumed", StrategyStepLlama(), _strategy(update_every=3), 8, ckpt_path=checkpoint, validate=True
    )
    for rank, (first, again) in enumerate(zip(straight, resumed, strict=True)):
        assert again["losses"] == first["losses"][4:], rank
        assert first["state"].keys() == again["state"].keys()
        for name, value in first["state"].items():
            assert torch.equal(value, again["state"][name]), (rank, name)
        for index, state in first["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(again["optimizer"]["state"][index][key]))
    from lightning_hetero.subspace_pipeline.basis import orthonormal_basis

    bases = [record["state"]["model.stage.subspace.basis"] for record in straight]
    assert torch.equal(bases[0], bases[1])  # both stages on one basis after two updates...
    assert (bases[0] - orthonormal_basis(32, 8, 0)).abs().max() > 1e-3  # ...which moved away from the initial one
    assert sum(record["losses"][-1] < record["losses"][0] - 0.3 for record in straight) == 2


def _reference_module() -> CausalLMModule:
    return CausalLMModule(
        preset="llama-tiny",
        config=TINY_LLAMA,
        learning_rate=1e-2,
        warmup_steps=0,
        min_lr_ratio=1.0,
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_trainer_runs_the_reference_causal_lm_module_with_gpipe(tmp_path):
    """CausalLMModule builds its HF model in configure_model and groups parameters for weight decay itself."""
    records = _fit(tmp_path, _reference_module(), _strategy(schedule="gpipe"), max_steps=6)
    for record in records:
        assert record["losses"][-1] < record["losses"][0] - 0.2, record["losses"]


# ---------------------------------------------------------------------------------------------------------- Fabric
def _fabric_train(fabric: Fabric, out: Path) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=False))
    model = fabric.setup_module(model)  # becomes this rank's stage
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(progressions(4), batch_size=4, shuffle=False))
    batches = [batch for _ in range(8) for batch in loader]
    strategy = fabric.strategy

    def step(batch: dict[str, torch.Tensor]) -> float:
        loss = strategy.train_step(batch)  # forward + backward of every microbatch
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    losses = [step(batch) for batch in batches[:4]]
    fabric.save(out / "fabric.ckpt", {"model": model, "optimizer": optimizer, "steps": len(losses)})
    losses += [step(batch) for batch in batches[4:]]
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {"model": model, "optimizer": optimizer, "steps": 0}
    fabric.load(out / "fabric.ckpt", state)
    again = [step(batch) for batch in batches[4:]]
    exported = strategy.export_dense(out / "hf")  # collective; rank 0 writes a plain HF checkpoint
    export_loss = None
    if exported is not None:
        from transformers import AutoModelForCausalLM

        from lightning_hetero.subspace_pipeline.stages import causal_lm_loss

        dense = AutoModelForCausalLM.from_pretrained(exported)
        with torch.no_grad():
            export_loss = causal_lm_loss(dense(input_ids=batches[0]["input_ids"]).logits, batches[0]["labels"]).item()
    record = {
        "stage": strategy.stage_index,
        "export_loss": export_loss,
        "losses": losses,
        "again": again,
        "steps": state["steps"],
        "val": strategy.eval_step(batches[0]).item(),
        "final": final,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
    torch.save(record, out / f"rank{fabric.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fabric_loss_falls_and_resume_is_bit_identical(tmp_path):
    settings = SubspacePipelineSettings(subspace_dim=8, n_microbatches=2)
    strategy = FabricSubspacePipelineStrategy(settings=settings, start_method="spawn")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(_fabric_train, tmp_path)
    stage0, stage1 = (torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2))
    assert (stage0["stage"], stage1["stage"]) == (0, 1)
    assert stage0["losses"] == stage1["losses"] and stage0["val"] == stage1["val"]
    assert abs(stage0["export_loss"] - stage0["val"]) < 1e-5  # plain transformers reproduces the pipeline model
    for record in (stage0, stage1):
        assert sum(record["losses"][-2:]) / 2 < record["losses"][0] - 0.3, record["losses"]
        assert record["steps"] == 4
        assert record["again"] == record["losses"][4:]  # fabric.save at step 4, fabric.load replays 5-8 bit for bit
        assert all(torch.equal(value, record["state"][name]) for name, value in record["final"].items())
