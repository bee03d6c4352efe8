"""MatFormer callbacks in real (tiny, CPU, in-process) Trainer runs: sampler, per-tier evaluation, per-tier export."""

from __future__ import annotations

import csv
import itertools
import math
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lightning_hetero import MatFormerStrategy
from lightning_hetero.data.base import FixedOrderSampler, fair_prefix
from lightning_hetero.matformer.adapters import find_ffns
from lightning_hetero.matformer.settings import MatFormerSettings
from lightning_hetero.matformer.slicing import tier_view
from lightning_hetero.models import CausalLMModule
from lightning_hetero.strategies.matformer.callbacks import MatFormerSampler, TierEvaluation, TierExport
from lightning_hetero.strategies.matformer.callbacks.tier_common import find_hf_model, max_tier
from tests.usercode.usernets import UserLlama

VOCAB = 96
FULL = 64  # FFN size of the tiny model: tiers 0..3 are widths 64, 32, 16, 8
TINY = {
    "hidden_size": 32,
    "intermediate_size": FULL,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}


class _Tokens(LightningDataModule):
    """Random token blocks: ``n_train`` / ``n_val`` sequences, unshuffled, plus an optional ``tokenizer``."""

    def __init__(self, n_train: int = 32, n_val: int = 12, batch_size: int = 4, tokenizer: Any = None) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, VOCAB, (n_train + n_val, 16), generator=generator)
        self.rows = [{"input_ids": row, "labels": row} for row in ids]
        self.n_train = n_train
        self.batch_size = batch_size
        self.tokenizer = tokenizer

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows[: self.n_train], batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        # In a fixed seeded order, like our DataModules: TierEvaluation then reads the batches Lightning's loop read.
        rows = self.rows[self.n_train :]
        return DataLoader(rows, batch_size=self.batch_size, sampler=FixedOrderSampler(len(rows), seed=0))


class _FakeTokenizer:
    def save_pretrained(self, path: str | Path) -> None:
        Path(path, "tokenizer_marker.json").write_text("{}")


class _TieredStrategy(SingleDeviceStrategy):
    """Stands in for MatFormerStrategy: a strategy with a ``tier``."""

    tier = 0


def _module(**kwargs: Any) -> CausalLMModule:
    torch.manual_seed(0)
    return CausalLMModule(preset="llama-tiny", config=dict(TINY), warmup_steps=0, learning_rate=1e-2, **kwargs)


def _trainer(callbacks: list[Callback], **kwargs: Any) -> Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    defaults.update(kwargs)
    return Trainer(callbacks=callbacks, **defaults)


def _patched(module: LightningModule) -> list[str]:
    return [name for name, sub in module.named_modules() if "forward" in sub.__dict__]


def _tier_of_width(width: int) -> int:
    return int(math.log2(FULL // width))


class _Inspector(Callback):
    """Records the FFN width every forward actually used and checks gradients and the sampler's context."""

    def __init__(self, sampler: MatFormerSampler) -> None:
        self.sampler = sampler
        self.last_width: int | None = None
        self.backward_tiers: list[int] = []  # one per training micro-batch, from the forward's FFN width
        self.step_tiers: list[list[int]] = []  # tiers whose gradient reached each optimizer step
        self.val_widths: list[int] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            self.last_width = output.shape[-1]

        pl_module.model.model.layers[0].mlp.gate_proj.register_forward_hook(hook)
        self._pending: list[int] = []

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        tier = _tier_of_width(self.last_width)
        assert self.sampler.current_tier == tier, "the forward ran at the sampler's tier, inside its context"
        self.backward_tiers.append(tier)
        self._pending.append(tier)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self.sampler.current_tier == self._pending[-1], "backward runs inside the context"

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        assert self.sampler.current_tier == self._pending[-1], "the optimizer step runs inside the context"
        widest = FULL >> min(self._pending)
        params = dict(pl_module.named_parameters())
        for block in find_ffns(pl_module):
            for spec in block.parameters:
                grad = params[spec.name].grad
                suffix = grad.narrow(spec.axis, widest, FULL - widest)
                assert int(torch.count_nonzero(suffix)) == 0, f"{spec.name}: suffix gradient is not exactly zero"
                assert int(torch.count_nonzero(grad.narrow(spec.axis, 0, widest))) > 0
        self.step_tiers.append(list(self._pending))
        self._pending = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        assert self.sampler.current_tier is None and not _patched(pl_module), "the context is closed after the batch"

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.val_widths.append(self.last_width)


# ---------------------------------------------------------------------------------------------------- sampler
def _fit_sampler(sampler: MatFormerSampler, max_steps: int, **kwargs: Any) -> tuple[_Inspector, Trainer]:
    inspector = _Inspector(sampler)
    trainer = _trainer([sampler, inspector], max_steps=max_steps, **kwargs)
    trainer.fit(_module(), datamodule=_Tokens())
    return inspector, trainer


def test_random_rule_is_seeded_logged_and_trains_only_the_prefix(tmp_path):
    sampler = MatFormerSampler(tiers=[0, 1, 2, 3], seed=3)
    inspector, _ = _fit_sampler(
        sampler,
        max_steps=12,
        logger=CSVLogger(tmp_path, name="log"),
        log_every_n_steps=1,
        limit_val_batches=1,
        val_check_interval=4,
    )
    assert len(sampler.history) == 12
    assert set(sampler.history) <= {0, 1, 2, 3} and len(set(sampler.history)) > 1
    # The forward of every micro-batch ran at the drawn tier; each step's grads came from exactly that tier.
    assert inspector.backward_tiers == sampler.history
    assert inspector.step_tiers == [[tier] for tier in sampler.history]
    assert inspector.val_widths and set(inspector.val_widths) == {FULL}, "validation runs at full width"
    # Deterministic: a fresh sampler with the same seed draws the same sequence; another seed does not.
    fresh = MatFormerSampler(tiers=[0, 1, 2, 3], seed=3)
    assert [fresh.next_plan()[0] for _ in range(12)] == sampler.history
    other = MatFormerSampler(tiers=[0, 1, 2, 3], seed=4)
    assert [other.next_plan()[0] for _ in range(12)] != sampler.history
    assert sampler.counts == {tier: sampler.history.count(tier) for tier in (0, 1, 2, 3)}
    # The logged train/tier per step matches.
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = {int(row["step"]): int(float(row["train/tier"])) for row in rows if row.get("train/tier")}
    assert [logged[step] for step in range(12)] == sampler.history


def test_random_rule_keeps_one_tier_per_optimizer_step_under_accumulation():
    sampler = MatFormerSampler(tiers=[1, 3], seed=0)
    inspector, _ = _fit_sampler(sampler, max_steps=4, accumulate_grad_batches=2)
    assert len(inspector.step_tiers) == 4
    for tiers in inspector.step_tiers:
        assert len(tiers) == 2 and tiers[0] == tiers[1] and tiers[0] in (1, 3)


def test_sandwich_cycles_largest_smallest_and_random_middle():
    sampler = MatFormerSampler(tiers=[0, 1, 2, 3], rule="sandwich", seed=1)
    inspector, _ = _fit_sampler(sampler, max_steps=4, accumulate_grad_batches=4)
    assert len(inspector.step_tiers) == 4
    middles = []
    for tiers in inspector.step_tiers:
        assert tiers[:2] == [0, 3] and set(tiers[2:]) <= {1, 2} and len(tiers) == 4
        middles += tiers[2:]
    assert set(middles) == {1, 2}
    fresh = MatFormerSampler(tiers=[0, 1, 2, 3], rule="sandwich", seed=1)
    assert [fresh.next_plan() for _ in range(4)] == inspector.step_tiers


def test_sandwich_requires_matching_accumulation():
    sampler = MatFormerSampler(tiers=[0, 1, 3], rule="sandwich")
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=3\); got 2"):
        _fit_sampler(sampler, max_steps=2, accumulate_grad_batches=2)
    assert not sampler.history


def test_sandwich_warns_about_a_partial_last_step_only_when_an_epoch_ends():
    def fit(max_steps: int) -> None:
        sampler = MatFormerSampler(tiers=[0, 3], rule="sandwich")
        trainer = _trainer([sampler], max_steps=max_steps, accumulate_grad_batches=2)
        trainer.fit(_module(), datamodule=_Tokens(n_train=36))  # 9 batches per epoch

    with pytest.warns(UserWarning, match="9 training batches, not a multiple of accumulate_grad_batches=2"):
        fit(max_steps=5)  # 10 micro-batches: crosses the end of the first epoch
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*only part of the sandwich.*")
        fit(max_steps=4)


@pytest.mark.parametrize(("rule", "accumulate"), [("random", 1), ("sandwich", 3)])
def test_resume_continues_the_sequence(tmp_path, rule, accumulate):
    tiers = [0, 2, 3]
    data = dict(n_train=48, batch_size=4)  # 12 batches per epoch: resume lands mid-epoch, on a step boundary
    first = MatFormerSampler(tiers=tiers, rule=rule, seed=7)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = _trainer(
        [first, checkpoint],
        max_steps=4,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=True,
        default_root_dir=tmp_path / "a",
    )
    trainer.fit(_module(), datamodule=_Tokens(**data))
    assert len(first.history) == 4 * accumulate

    resumed = MatFormerSampler(tiers=tiers, rule=rule, seed=7)
    trainer = _trainer([resumed], max_steps=4, accumulate_grad_batches=accumulate, default_root_dir=tmp_path / "b")
    trainer.fit(_module(), datamodule=_Tokens(**data), ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert resumed.history == first.history[2 * accumulate :]
    assert resumed.counts == {tier: first.history.count(tier) for tier in tiers}


def test_state_round_trip_and_changed_settings():
    saved = MatFormerSampler(tiers=[0, 1, 2], rule="sandwich", seed=1)
    for _ in range(3):
        saved.next_plan()
    same = MatFormerSampler(tiers=[0, 1, 2], rule="sandwich", seed=1)
    same.load_state_dict(saved.state_dict())
    assert [same.next_plan() for _ in range(5)] == [saved.next_plan() for _ in range(5)]

    changed = MatFormerSampler(tiers=[0, 1, 2], rule="sandwich", seed=2)
    with pytest.warns(UserWarning, match="restarts from this run's seed"):
        changed.load_state_dict(saved.state_dict())
    fresh = MatFormerSampler(tiers=[0, 1, 2], rule="sandwich", seed=2)
    assert [changed.next_plan() for _ in range(5)] == [fresh.next_plan() for _ in range(5)]


class _Failing(CausalLMModule):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_context_is_closed_when_training_fails():
    torch.manual_seed(0)
    module = _Failing(preset="llama-tiny", config=dict(TINY), warmup_steps=0)
    sampler = MatFormerSampler(tiers=[1], seed=0)  # every step patched
    with pytest.raises(RuntimeError, match="boom"):
        _trainer([sampler], max_steps=5).fit(module, datamodule=_Tokens())
    assert sampler.current_tier is None and not _patched(module)


def test_sampler_refuses_a_tiered_strategy():
    sampler = MatFormerSampler()
    trainer = _trainer([sampler], max_steps=1, strategy=_TieredStrategy(device=torch.device("cpu")))
    with pytest.raises(RuntimeError, match="is tiered .*Remove MatFormerSampler"):
        trainer.fit(_module(), datamodule=_Tokens())


def test_sampler_rejects_tiers_the_model_cannot_run():
    with pytest.raises(ValueError, match=r"tier 7 .*supports tiers 0\.\.6"):
        _fit_sampler(MatFormerSampler(tiers=[0, 7]), max_steps=1)


# ------------------------------------------------------------------------------------------------- evaluation
def test_tier_evaluation_logs_every_tier_and_tier0_equals_val_loss():
    evaluation = TierEvaluation(tiers=[0, 1, 2, 3])
    calls = []
    original = evaluation.evaluate
    evaluation.evaluate = lambda *args, **kw: calls.append(args[2]) or original(*args, **kw)  # type: ignore[method-assign]
    module = _module()
    trainer = _trainer([evaluation], max_epochs=1, limit_train_batches=2, limit_val_batches=2, num_sanity_val_steps=1)
    trainer.fit(module, datamodule=_Tokens())
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    assert calls == [0, 1, 2, 3], "one evaluation per tier after the epoch, none during the sanity check"
    for tier in range(4):
        assert math.isclose(
            metrics[f"val/perplexity_tier{tier}"], math.exp(metrics[f"val/loss_tier{tier}"]), rel_tol=1e-6
        )
    assert abs(metrics["val/loss_tier0"] - metrics["val/loss"]) < 1e-5
    assert len({round(metrics[f"val/loss_tier{t}"], 6) for t in range(4)}) == 4
    # Tier 2 by hand: the same two validation batches under tier_view.
    batches = list(_Tokens().val_dataloader())[:2]
    module.eval()
    with torch.no_grad(), tier_view(module, 2):
        expected = sum(float(module(**b).loss) * b["labels"].shape[0] for b in batches) / 8
    assert abs(metrics["val/loss_tier2"] - expected) < 1e-6
    assert evaluation.results[2]["loss"] == pytest.approx(expected, abs=1e-6)


def test_tier_evaluation_in_validate_with_limit_and_a_tiered_strategy():
    evaluation = TierEvaluation(tiers=[3, 1], limit_batches=1)
    trainer = _trainer([evaluation], limit_val_batches=3, strategy=_TieredStrategy(device=torch.device("cpu")))
    module = _module()
    trainer.validate(module, datamodule=_Tokens())
    first = next(iter(_Tokens().val_dataloader()))
    with torch.no_grad(), tier_view(module, 3):
        expected = float(module(**first).loss)
    assert float(trainer.callback_metrics["val/loss_tier3"]) == pytest.approx(expected, abs=1e-6)
    assert "val/loss_tier1" in trainer.callback_metrics and "val/loss_tier0" not in trainer.callback_metrics


def test_tier_evaluation_does_not_evaluate_on_non_zero_ranks_of_a_tiered_strategy():
    # Rank 1 holds a sliced model: it evaluates nothing and logs what rank 0 broadcasts (none here: one process).
    evaluation = TierEvaluation(tiers=[2])
    evaluation.resolved_tiers = [2]
    fake_trainer = SimpleNamespace(strategy=SimpleNamespace(tier=2), global_rank=1, world_size=1, sanity_checking=False)
    module = SimpleNamespace(log=lambda *a, **k: pytest.fail("nothing to log"))
    evaluation.on_validation_epoch_end(fake_trainer, module)  # type: ignore[arg-type]
    assert evaluation.results == {}


class _Probe(UserLlama):
    """A user's module that counts its training steps (to show a failure comes before the first one)."""

    steps_seen = 0

    def training_step(self, batch, batch_idx):
        self.steps_seen += 1
        return super().training_step(batch, batch_idx)


def test_tier_evaluation_runs_a_user_module_through_its_validation_step():
    module = _Probe(val_items=32)  # 4 validation batches of 8, in storage order; own loaders, no forward(**batch)
    evaluation = TierEvaluation(tiers=[0, 2])
    trainer = _trainer([evaluation], max_steps=2, limit_val_batches=2, val_check_interval=2)
    trainer.fit(module)
    loader = fair_prefix(module.val_dataloader(), 2)
    batches = list(itertools.islice(loader, 2))
    module.eval()
    for tier in (0, 2):
        with torch.no_grad(), tier_view(module, tier):
            expected = sum(float(module.model(**b).loss) * 8 for b in batches) / 16
        assert float(trainer.callback_metrics[f"val/loss_tier{tier}"]) == pytest.approx(expected, abs=1e-6)
    # The module's own val_loss is Lightning's: its first two batches in storage order, none of ours mixed in.
    with torch.no_grad():
        own = sum(float(module.model(**b).loss) for b in list(module.val_dataloader())[:2]) / 2
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(own, abs=1e-6)


class _NoValidation(_Probe):
    validation_step = LightningModule.validation_step  # a module written without validation_step


def test_tier_evaluation_without_validation_step_fails_before_the_first_step():
    module = _NoValidation()
    with pytest.raises(TypeError, match=r"TierEvaluation .*_NoValidation defines neither validation_step nor"):
        _trainer([TierEvaluation(tiers=[0, 1])], max_steps=2).fit(module)
    assert module.steps_seen == 0


def test_tier_evaluation_with_a_metric_the_module_never_logs_fails_before_the_first_step():
    module = _Probe()
    evaluation = TierEvaluation(tiers=[0, 1], metric="val_accuracy", limit_batches=1)
    with pytest.raises(RuntimeError, match=r"TierEvaluation\(metric='val_accuracy'\).*it logged \['val_loss'\]"):
        _trainer([evaluation], max_steps=2, limit_val_batches=1, val_check_interval=2).fit(module)
    assert module.steps_seen == 0


def test_tier_evaluation_rejects_tiers_the_model_cannot_run():
    trainer = _trainer([TierEvaluation(tiers=[9])], max_steps=1)
    with pytest.raises(ValueError, match=r"TierEvaluation\(tiers=\[9\]\): tier 9"):
        trainer.fit(_module(), datamodule=_Tokens())


# ---------------------------------------------------------------------------------------------------- export
def test_tier_export_writes_loadable_checkpoints_with_the_tier_logits(tmp_path):
    export = TierExport(dirpath=str(tmp_path / "tiers"), tiers=[0, 2])
    module = _module()
    _trainer([export], max_steps=2).fit(module, datamodule=_Tokens(tokenizer=_FakeTokenizer()))
    assert sorted(export.exported) == [0, 2]
    input_ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    hf = module.model.eval()
    for tier in (0, 2):
        path = tmp_path / "tiers" / f"tier{tier}"
        assert export.exported[tier] == path and (path / "tokenizer_marker.json").is_file()
        loaded = AutoModelForCausalLM.from_pretrained(path).eval()
        assert loaded.config.intermediate_size == FULL >> tier
        with torch.no_grad(), tier_view(hf, tier):
            expected = hf(input_ids=input_ids).logits
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=input_ids).logits, expected, atol=1e-5, rtol=0)


def test_tier_export_prints_no_progress_bars_and_restores_the_setting(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    _trainer([TierExport(dirpath=str(tmp_path), tiers=[0, 1])], max_steps=1).fit(_module(), datamodule=_Tokens())
    assert (tmp_path / "tier1" / "model.safetensors").is_file()
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled(), "the caller's setting is restored"


def test_tier_export_tiers_from_the_sampler_and_no_tokenizer(tmp_path):
    export = TierExport(dirpath=str(tmp_path), save_tokenizer=False)
    sampler = MatFormerSampler(tiers=[0, 1, 3])
    _trainer([sampler, export], max_steps=1).fit(_module(), datamodule=_Tokens(tokenizer=_FakeTokenizer()))
    assert sorted(export.exported) == [0, 1, 3]
    assert not list(tmp_path.rglob("tokenizer_marker.json"))


class _NoHF(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.linear(batch["input_ids"].float()[:, :4]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_find_hf_model():
    module = _module()
    module.configure_model()
    assert find_hf_model(module) is module.model
    holder = torch.nn.ModuleDict({"encoder": torch.nn.Linear(2, 2), "lm": module.model})
    assert find_hf_model(holder) is module.model
    assert max_tier(find_ffns(module)) == 6  # FFN size 64 halves 6 times
    with pytest.raises(ValueError, match="TierExport needs a Hugging Face PreTrainedModel inside _NoHF"):
        find_hf_model(_NoHF())


def test_tier_export_fails_before_training_without_an_hf_model(tmp_path):
    trainer = _trainer([TierExport(dirpath=str(tmp_path), tiers=[0, 1])], max_steps=1)
    with pytest.raises(ValueError, match="PreTrainedModel"):
        trainer.fit(_NoHF(), datamodule=_Tokens())


# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: MatFormerSampler(tiers=[]), "at least one tier"),
        (lambda: MatFormerSampler(tiers=[0, 0]), "distinct"),
        (lambda: MatFormerSampler(tiers=[0, -1]), "int >= 0"),
        (lambda: MatFormerSampler(tiers=[0, True]), "int >= 0"),
        (lambda: MatFormerSampler(tiers="0,1"), "list of tiers"),
        (lambda: MatFormerSampler(rule="uniform"), "rule='uniform'"),
        (lambda: MatFormerSampler(tiers=[2], rule="sandwich"), "at least two tiers"),
        (lambda: MatFormerSampler(seed=1.5), "seed"),
        (lambda: TierEvaluation(limit_batches=0), "limit_batches=0"),
        (lambda: TierEvaluation(tiers=[1, 1]), r"TierEvaluation\(tiers"),
        (lambda: TierExport(dirpath=""), "dirpath"),
        (lambda: TierExport(dirpath="x", tiers=[-2]), r"TierExport\(tiers"),
        (lambda: TierExport(dirpath="x", save_tokenizer="yes"), "save_tokenizer"),
    ],
)
def test_bad_arguments_raise(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


# ------------------------------------------------------------------------------------------- where tiers come from
def _matformer_trainer(callbacks: list[Callback], settings: MatFormerSettings) -> Trainer:
    """A Trainer with a 2-rank MatFormerStrategy; nothing is launched before fit, so callbacks can be set up by hand."""
    return _trainer(callbacks, devices=2, strategy=MatFormerStrategy(settings=settings))


@pytest.mark.parametrize("factory", [lambda: TierEvaluation(), lambda: TierExport(dirpath="x")], ids=["eval", "export"])
@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (MatFormerSettings(tiers=[0, 2]), [0, 2]),
        (MatFormerSettings(tiers=[0, 2, 2, 1]), [0, 1, 2]),  # per rank on 2 nodes: the distinct tiers, sorted
        (MatFormerSettings(), [0]),  # no tiers: every rank trains tier 0
    ],
)
def test_callbacks_without_tiers_read_the_matformer_strategys_tiers(factory, settings, expected):
    callback = factory()
    trainer = _trainer(
        [callback],
        devices=2,
        num_nodes=2 if len(settings.tiers or []) == 4 else 1,
        strategy=MatFormerStrategy(settings=settings),
    )
    callback.setup(trainer, _module(), "fit")
    assert callback.resolved_tiers == expected
    assert callback.tiers is None, "the argument itself is kept as given"


@pytest.mark.parametrize(
    ("factory", "owner"),
    [(lambda: TierEvaluation(tiers=[0, 1]), "TierEvaluation"), (lambda: TierExport("x", tiers=[1, 0]), "TierExport")],
)
def test_callback_tiers_that_leave_out_a_trained_tier_fail_naming_both(factory, owner):
    trainer = _matformer_trainer([factory()], MatFormerSettings(tiers=[0, 2]))
    with pytest.raises(
        ValueError, match=rf"{owner}\(tiers=\[[01], [01]\]\).*MatFormerSettings.tiers=\[0, 2\].*tier\(s\) \[2\]"
    ):
        trainer.callbacks[0].setup(trainer, _module(), "fit")


def test_callback_tiers_may_add_tiers_to_the_strategys():
    same = TierEvaluation(tiers=[2, 0])  # the same tiers in another order are the same tiers
    same.setup(_matformer_trainer([same], MatFormerSettings(tiers=[0, 2])), _module(), "fit")
    assert same.resolved_tiers == [2, 0]
    # An all-tier-0 run evaluated at tier 1 too: the untrained-for half-width slice, as a reference.
    reference = TierEvaluation(tiers=[0, 1])
    reference.setup(_matformer_trainer([reference], MatFormerSettings(tiers=[0, 0])), _module(), "fit")
    assert reference.resolved_tiers == [0, 1]


@pytest.mark.parametrize(
    "settings", [MatFormerSettings(tiers=[0, [1, 2]]), MatFormerSettings(widths=[64, 48])], ids=["per-ffn", "widths"]
)
def test_callbacks_without_tiers_need_them_when_the_strategy_names_no_single_tier(settings):
    evaluation = TierEvaluation()
    with pytest.raises(ValueError, match=r"TierEvaluation: .*pass TierEvaluation\(tiers=\[\.\.\.\]\)"):
        evaluation.setup(_matformer_trainer([evaluation], settings), _module(), "fit")
    given = TierEvaluation(tiers=[0, 1])  # given tiers cannot be compared with per-FFN tiers or widths: used as given
    given.setup(_matformer_trainer([given], settings), _module(), "fit")
    assert given.resolved_tiers == [0, 1]


@pytest.mark.parametrize("factory", [lambda: TierEvaluation(), lambda: TierExport(dirpath="x")], ids=["eval", "export"])
def test_callbacks_without_tiers_fail_before_training_under_another_strategy(factory):
    module = _Probe()
    callback = factory()
    name = type(callback).__name__
    with pytest.raises(ValueError, match=rf"{name}: no tiers given.*SingleDeviceStrategy.*pass {name}\(tiers=\["):
        _trainer([callback], max_steps=2).fit(module)
    assert module.steps_seen == 0


def test_callbacks_without_tiers_read_the_samplers_tiers():
    sampler = MatFormerSampler(tiers=[0, 2, 3])
    evaluation, export = TierEvaluation(), TierExport(dirpath="x")
    trainer = _trainer([sampler, evaluation, export])
    for callback in (evaluation, export):
        callback.setup(trainer, _module(), "fit")
        assert callback.resolved_tiers == [0, 2, 3]
