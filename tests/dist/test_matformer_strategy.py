"""MatFormerStrategy on 2 spawned CPU ranks (gloo): Trainer and Fabric, on tiny Llama models and random-ish tokens.

Every fit spawns its own ranks (``start_method="spawn"``: the popen launcher would re-run pytest). Each rank writes
what the assertions need (losses, parameters, optimizer state, FFN sizes) to ``tmp_path`` from a callback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero import MatFormerStrategy
from lightning_hetero.fabric import MatFormerStrategy as FabricMatFormerStrategy
from lightning_hetero.matformer import find_ffns
from lightning_hetero.matformer.compressed import CHECKPOINT_KEY
from lightning_hetero.matformer.settings import MatFormerSettings
from lightning_hetero.models import CausalLMModule
from lightning_hetero.replication.settings import ReplicationSettings
from tests.fixtures import TinyLlama, TokenData, fit_ranks
from tests.token_data import TINY_LLAMA, progressions

DEMO_QUARTER = MatFormerSettings(tiers=[0, 1], mode="demo", replication=ReplicationSettings(kept_fraction=0.25))

CLIP = 0.5


def _matformer_fields(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """This rank's tier and FFN size (runs before the strategy's on_train_end, which gives every rank the full model
    back)."""
    return {
        "tier": getattr(trainer.strategy, "tier", None),
        "ffn_numel": sum(p.numel() for b in find_ffns(pl_module) for p in _params(pl_module, b)),
        "ffn_width": find_ffns(pl_module)[0].width,
    }


def _params(module: torch.nn.Module, block: Any) -> list[torch.Tensor]:
    named = dict(module.named_parameters())
    return [named[spec.name] for spec in block.parameters]


def _fit(
    out: Path,
    module: L.LightningModule,
    strategy: Any,
    max_steps: int,
    checkpoint: Path | None = None,
    ckpt_path: Path | None = None,
    gradient_clip_val: float | None = None,
) -> list[dict[str, Any]]:
    """4 sequences, batch 2: every epoch is one batch per rank, the same one (each rank has its own two sequences).

    So the batch of a step does not depend on how Lightning re-enters an epoch on resume (its data-loop bookkeeping,
    not ours); the resume test then checks exactly what the strategy restores: parameters and optimizer state.
    """
    data = TokenData(4, batch_size=2)
    return fit_ranks(
        out,
        module,
        data,
        strategy,
        max_steps,
        checkpoint,
        ckpt_path,
        recorder={"fields": _matformer_fields},
        gradient_clip_val=gradient_clip_val,
    )


@pytest.fixture(scope="module")
def tiered_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Tiers [0, 1] for 8 uninterrupted steps, with norm clipping (active: the norms exceed 0.5) and tier losses."""
    out = tmp_path_factory.mktemp("tiered")
    strategy = MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1], log_tier_losses=True), start_method="spawn")
    return _fit(out, TinyLlama(), strategy, max_steps=8, gradient_clip_val=CLIP)


@pytest.mark.timeout(120)
def test_tiers_train_both_and_tier1_holds_half_the_ffn(tiered_run):
    tier0, tier1 = tiered_run
    assert (tier0["tier"], tier1["tier"]) == (0, 1)
    assert (tier0["ffn_width"], tier1["ffn_width"]) == (64, 32)
    assert tier1["ffn_numel"] * 2 == tier0["ffn_numel"]  # physically sliced: half the FFN parameters
    for record in tiered_run:
        losses = record["losses"]
        assert len(losses) == 8
        assert sum(losses[-2:]) / 2 < losses[0] - 0.3, losses
    # Each rank logs every tier's loss (one all-reduce per step): the last step's losses of both ranks.
    for record in tiered_run:
        assert record["metrics"]["train/loss_tier0"] == pytest.approx(tier0["losses"][-1], rel=1e-6)
        assert record["metrics"]["train/loss_tier1"] == pytest.approx(tier1["losses"][-1], rel=1e-6)
    # The shared (non-FFN) weights stay bitwise identical (one all-reduce per region and one clipping coefficient
    # for all ranks), and tier 1's FFN is exactly tier 0's prefix.
    ffn = {spec.name: spec for block in find_ffns(TinyLlama()) for spec in block.parameters}
    for name, value in tier0["state"].items():
        other = tier1["state"][name]
        expected = value.narrow(ffn[name].axis, 0, other.shape[ffn[name].axis]) if name in ffn else value
        assert torch.equal(other, expected), name


@pytest.mark.timeout(180)
def test_resume_is_bit_identical_on_every_rank(tiered_run, tmp_path):
    checkpoint = tmp_path / "step4.ckpt"
    strategy = MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1]), start_method="spawn")
    _fit(tmp_path / "first", TinyLlama(), strategy, 4, checkpoint=checkpoint, gradient_clip_val=CLIP)
    strategy = MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1]), start_method="spawn")
    resumed = _fit(tmp_path / "resumed", TinyLlama(), strategy, 8, ckpt_path=checkpoint, gradient_clip_val=CLIP)
    for rank, (straight, again) in enumerate(zip(tiered_run, resumed, strict=True)):
        assert again["losses"] == straight["losses"][4:], rank
        assert straight["state"].keys() == again["state"].keys()
        for name, value in straight["state"].items():
            assert torch.equal(value, again["state"][name]), (rank, name)
        for index, state in straight["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(again["optimizer"]["state"][index][key]))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_mode_trains_both_tiers_and_resumes_bit_identically(tmp_path):
    """mode="demo" keeping 1/4 of the DCT coefficients: both tiers learn, shared weights stay identical, and the
    checkpoint carries every rank's error-feedback buffers, so resuming replays the straight run bit for bit."""

    def strategy() -> MatFormerStrategy:
        return MatFormerStrategy(settings=DEMO_QUARTER, start_method="spawn")

    straight = _fit(tmp_path / "straight", TinyLlama(), strategy(), 8, gradient_clip_val=CLIP)
    for record in straight:
        assert sum(record["losses"][-2:]) / 2 < record["losses"][0] - 0.3, record["losses"]
    ffn = {spec.name: spec for block in find_ffns(TinyLlama()) for spec in block.parameters}
    for name, value in straight[0]["state"].items():
        other = straight[1]["state"][name]
        expected = value.narrow(ffn[name].axis, 0, other.shape[ffn[name].axis]) if name in ffn else value
        assert torch.equal(other, expected), name
    checkpoint = tmp_path / "step4.ckpt"
    _fit(tmp_path / "first", TinyLlama(), strategy(), 4, checkpoint=checkpoint, gradient_clip_val=CLIP)
    buffers = torch.load(checkpoint, weights_only=True)[CHECKPOINT_KEY]
    # One buffer per rank: the 2-rank bucket (tier 0's suffix has one member, sent exactly, no buffer).
    assert buffers["world_size"] == 2 and buffers["ranks"][0].keys() == buffers["ranks"][1].keys()
    assert len(buffers["ranks"][0]) == 1 and not torch.equal(*(next(iter(r.values())) for r in buffers["ranks"]))
    resumed = _fit(tmp_path / "resumed", TinyLlama(), strategy(), 8, ckpt_path=checkpoint, gradient_clip_val=CLIP)
    for rank, (first, again) in enumerate(zip(straight, resumed, strict=True)):
        assert again["losses"] == first["losses"][4:], rank
        for name, value in first["state"].items():
            assert torch.equal(value, again["state"][name]), (rank, name)


@pytest.mark.timeout(120)
def test_helpers_on_full_weights_keep_every_replica_identical(tmp_path):
    """slice_weights=False with helpers: tier 1 trains its prefix plus a rotating draw of tail neurons through the
    activation mask, and joins the tail's exchange, so both ranks stay bit-identical copies of one full model."""
    settings = MatFormerSettings(tiers=[0, 1], slice_weights=False, helper_fraction=0.5, helper_redraw_every=2)
    strategy = MatFormerStrategy(settings=settings, start_method="spawn")
    tier0, tier1 = _fit(tmp_path, TinyLlama(), strategy, max_steps=6, gradient_clip_val=CLIP)
    assert (tier0["tier"], tier1["tier"], tier1["ffn_width"]) == (0, 1, 64)  # full-size weights on tier 1
    assert tier0["losses"] != tier1["losses"]  # tier 1 ran its own (masked) forward
    for record in (tier0, tier1):
        assert record["losses"][-1] < record["losses"][0] - 0.2, record["losses"]
    for name, value in tier0["state"].items():
        assert torch.equal(value, tier1["state"][name]), name


def _reference_module() -> CausalLMModule:
    return CausalLMModule(preset="llama-tiny", config=TINY_LLAMA, learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0)


@pytest.mark.timeout(180)
def test_all_tier0_equals_ddp_on_the_reference_module(tmp_path):
    """CausalLMModule builds its HF model in configure_model; all ranks at tier 0 must reproduce DDP's averaging."""
    ours = _fit(tmp_path / "matformer", _reference_module(), MatFormerStrategy(start_method="spawn"), max_steps=10)
    ddp = _fit(tmp_path / "ddp", _reference_module(), DDPStrategy(start_method="spawn"), max_steps=10)
    for rank in range(2):
        assert ours[rank]["ffn_width"] == 64
        for name, value in ddp[rank]["state"].items():
            torch.testing.assert_close(ours[rank]["state"][name], value, rtol=0, atol=1e-6, msg=name)
        assert ours[rank]["losses"][-1] < ours[rank]["losses"][0]


@pytest.mark.timeout(120)
def test_schema_mismatch_names_ranks_and_fields(tmp_path):
    module = TinyLlama(hidden_size_by_rank={0: 32, 1: 48})
    with pytest.raises(Exception, match=r"(?s)rank\(s\) 1 differs from rank 0.*hidden_size: 48 \(rank 1\) != 32"):
        _fit(
            tmp_path,
            module,
            MatFormerStrategy(settings=MatFormerSettings(tiers=[0, 1]), start_method="spawn"),
            max_steps=2,
        )


def _fabric_train(fabric: Fabric, out: Path) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=False))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(progressions(16), batch_size=2, shuffle=True))
    batches = [batch for _ in range(2) for batch in loader]  # 8 batches per rank

    def step(batch: dict[str, torch.Tensor]) -> float:
        with fabric.no_backward_sync(model, enabled=True):  # an accumulation micro-batch: no sync...
            fabric.backward(model(**batch).loss * 0.0)
        loss = model(**batch).loss
        fabric.backward(loss)  # ...then the real one syncs
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    losses = [step(batch) for batch in batches[:4]]
    fabric.save(out / "fabric.ckpt", {"model": model, "optimizer": optimizer})
    losses += [step(batch) for batch in batches[4:]]
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fabric.load(out / "fabric.ckpt", {"model": model, "optimizer": optimizer})  # rank 0's full state, sliced
    again = [step(batch) for batch in batches[4:]]
    strategy = fabric.strategy
    record = {
        "tier": strategy.tier,
        "losses": losses,
        "again": again,
        "ffn_width": find_ffns(model)[0].width,
        "syncs": strategy.step,
        "final": final,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
    torch.save(record, out / f"rank{fabric.global_rank}.pt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("settings", [MatFormerSettings(tiers=[0, 1]), DEMO_QUARTER], ids=["mean", "demo"])
def test_fabric_tiers_train_both_and_resume(tmp_path, settings):
    strategy = FabricMatFormerStrategy(settings=settings, start_method="spawn")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(_fabric_train, tmp_path)
    tier0, tier1 = (torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2))
    assert (tier0["tier"], tier1["tier"], tier0["ffn_width"], tier1["ffn_width"]) == (0, 1, 64, 32)
    assert tier0["syncs"] == tier1["syncs"] == 12  # the no_backward_sync micro-batches did not sync
    for record in (tier0, tier1):
        assert sum(record["losses"][-2:]) / 2 < record["losses"][0] - 0.3, record["losses"]
        # fabric.save at step 4 and fabric.load (sliced for tier 1) replay steps 5-8 bit for bit.
        assert record["again"] == record["losses"][4:]
        assert all(torch.equal(value, record["state"][name]) for name, value in record["final"].items())
    embed = "model.embed_tokens.weight"  # shared weights stay identical (one clipping coefficient for all ranks)
    assert torch.equal(tier0["state"][embed], tier1["state"][embed])
