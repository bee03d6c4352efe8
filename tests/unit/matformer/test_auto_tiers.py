"""``tiers: auto`` in one process: settings (Python and YAML), the probe on a tiny Llama, the runtime's choice, the
launch check, the callbacks' tier source, and an impossible fit failing before training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero.hetero.measure import peak_memory_bytes, reset_peak_memory
from lightning_hetero.hetero.tier_settings import AutoTierSettings
from lightning_hetero.matformer import auto_tiers
from lightning_hetero.matformer.adapters import find_ffns
from lightning_hetero.matformer.auto_tiers import ProbeStep, probe_tiers
from lightning_hetero.matformer.runtime import MatFormerRuntime
from lightning_hetero.matformer.settings import MatFormerSettings, expand_entries
from lightning_hetero.strategies.matformer.callbacks.tier_source import callback_tiers
from tests.token_data import TINY_LLAMA, progressions

CPU = torch.device("cpu")


def _model(width: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "intermediate_size": width}))


def _step() -> ProbeStep:
    batch = torch.utils.data.default_collate([progressions(2)[i] for i in range(2)])
    return ProbeStep(loss=lambda model: model(**batch).loss)


# ------------------------------------------------------------------------------------------------ settings
def test_auto_from_python_and_its_defaults():
    settings = MatFormerSettings(tiers="auto")
    assert settings.auto and settings.entries is None and settings.uniform_tiers is None
    assert settings.auto_settings == AutoTierSettings()
    assert settings.auto_settings.candidates == [0, 1, 2, 3] and settings.auto_settings.max_slowdown == 1.1
    tuned = MatFormerSettings(
        tiers="auto", auto_tiers=AutoTierSettings(candidates=[2, 0], memory_limit_bytes=[None, 5])
    )
    assert tuned.auto_settings.candidates == [0, 2] and tuned.auto_settings.memory_limit_bytes == [None, 5]
    assert not MatFormerSettings(tiers=[0, 1]).auto


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tiers": "fast"}, r"MatFormerSettings.tiers='fast': give a list .* 'auto'"),
        ({"tiers": [0, 1], "auto_tiers": AutoTierSettings()}, r"auto_tiers only applies to tiers='auto'"),
        ({"tiers": "auto", "auto_tiers": {"candidates": [0]}}, r"MatFormerSettings.auto_tiers=.*use AutoTierSettings"),
        ({"tiers": "auto", "tier_weights": [1.0, 1.0]}, r"tier_weights=.*one weight per tier 0..3"),
    ],
)
def test_bad_auto_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MatFormerSettings(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": [1, 2]}, r"AutoTierSettings.candidates=\[1, 2\]: give distinct tiers including 0"),
        ({"candidates": [0, -1]}, r"AutoTierSettings.candidates=.*int >= 0"),
        ({"candidates": []}, r"AutoTierSettings.candidates=\[\]"),
        ({"max_slowdown": 0.5}, r"AutoTierSettings.max_slowdown=0.5: use a number >= 1"),
        ({"memory_headroom": 1.0}, r"AutoTierSettings.memory_headroom=1.0: use a fraction in \[0, 1\)"),
        ({"probe_repeats": 0}, r"AutoTierSettings.probe_repeats=0: use an int >= 1"),
        ({"probe_warmup": -1}, r"AutoTierSettings.probe_warmup=-1: use an int >= 0"),
        ({"memory_limit_bytes": 5}, r"AutoTierSettings.memory_limit_bytes=5: give a list"),
        ({"memory_limit_bytes": [0]}, r"AutoTierSettings.memory_limit_bytes=\[0\]: every entry must be an int >= 1"),
        ({"mix_layers": "yes"}, r"AutoTierSettings.mix_layers='yes': use true or false"),
    ],
)
def test_bad_auto_tier_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoTierSettings(**kwargs)


def test_auto_from_yaml_reaches_the_strategy(tmp_path, monkeypatch):
    from lightning_hetero.cli import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n  strategy:\n"
        "    class_path: lightning_hetero.MatFormerStrategy\n    init_args:\n      settings:\n        tiers: auto\n"
        "        auto_tiers:\n          candidates: [0, 1]\n          max_slowdown: 1.5\n"
        "          memory_limit_bytes: [null]\n"
        "model:\n  class_path: lightning_hetero.models.CausalLMModule\n  init_args:\n    preset: llama-tiny\n"
        "data:\n  class_path: lightning_hetero.data.ShakespeareDataModule\n"
    )
    cli = build_cli(["--config", str(config)], run=False)
    settings = cli.trainer.strategy.settings
    assert settings.auto and settings.auto_settings.candidates == [0, 1]
    assert settings.auto_settings.max_slowdown == 1.5 and settings.auto_settings.memory_limit_bytes == [None]


# ------------------------------------------------------------------------------------------------ launch
def test_the_launch_check_accepts_auto_and_checks_the_memory_override():
    runtime = MatFormerRuntime(MatFormerSettings(tiers="auto"))
    assert runtime.resolve_world(4, 2) == [] and runtime.per_rank is None
    per_node = MatFormerRuntime(
        MatFormerSettings(tiers="auto", auto_tiers=AutoTierSettings(memory_limit_bytes=[None, 10**9]))
    )
    per_node.resolve_world(4, 2)  # one per node
    with pytest.raises(ValueError, match=r"auto_tiers.memory_limit_bytes=\[None, 1000000000\] has 2 entries.*3 ranks"):
        per_node.resolve_world(3, 1)
    with pytest.raises(ValueError, match="no entries before setup"):
        expand_entries("X", MatFormerSettings(tiers="auto"), 2, 1)


# ------------------------------------------------------------------------------------------------ probe
def test_probe_measures_every_candidate_and_narrower_tiers_need_less():
    model = _model(width=4096)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    settings = AutoTierSettings(candidates=[0, 1, 2], probe_repeats=1, probe_warmup=0)
    measurement = probe_tiers(model, find_ffns(model), CPU, settings, _step(), rank=0, limit=None)
    assert sorted(measurement.tiers) == [0, 1, 2] and measurement.memory_limit_bytes is None
    for probe in measurement.tiers.values():
        assert probe.step_seconds is not None and probe.step_seconds > 0 and probe.peak_bytes is not None
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())  # the original is untouched
    assert find_ffns(model)[0].width == 4096


def test_probe_skips_tiers_predicted_over_the_limit():
    model = _model(width=65536)  # 2 x 3 x 32 x 65536 FFN parameters: 50 MB, 200 MB of training state at tier 0
    settings = AutoTierSettings(candidates=[0, 1, 2, 3], probe_repeats=1, probe_warmup=0)
    reset_peak_memory(CPU)
    # 100 MiB above what the process holds now: tier 3 (about 28 MB of training state) is probed; tier 0 (at least
    # 200 MB) is predicted over the limit and never run.
    limit = peak_memory_bytes(CPU) + 100 * 2**20
    limited = probe_tiers(model, find_ffns(model), CPU, settings, _step(), rank=1, limit=limit)
    assert limited.tiers[3].peak_bytes is not None and limited.tiers[3].step_seconds is not None
    assert limited.tiers[0].peak_bytes is None and limited.tiers[0].step_seconds is None
    assert limited.memory_limit_bytes == limit


def test_state_the_probe_does_not_build_is_added_to_each_tier_peak(monkeypatch):
    """mode="demo": one fp32 error-feedback buffer per trained parameter; the probe adds its bytes to the peak."""
    model = _model(width=1024)
    settings = AutoTierSettings(candidates=[0, 1], probe_repeats=1, probe_warmup=0)
    monkeypatch.setattr(auto_tiers, "_probe_one", lambda *args: (0.1, 10**9))  # a fixed raw peak
    plain = probe_tiers(model, find_ffns(model), CPU, settings, _step(), rank=0, limit=None)
    demo = probe_tiers(
        model, find_ffns(model), CPU, settings, _step(), rank=0, limit=None, extra_state_per_parameter_byte=1.0
    )
    full = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert demo.tiers[0].peak_bytes - plain.tiers[0].peak_bytes == full
    ffn = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".mlp." in name)
    assert demo.tiers[1].peak_bytes - plain.tiers[1].peak_bytes == pytest.approx(full - ffn / 2, abs=1)


# ------------------------------------------------------------------------------------------------ runtime
def test_runtime_setup_chooses_logs_and_slices():
    model = _model(width=64)
    runtime = MatFormerRuntime(
        MatFormerSettings(tiers="auto", auto_tiers=AutoTierSettings(candidates=[0, 1], probe_repeats=1))
    )
    runtime.resolve_world(1, 1)
    runtime.auto_probe = _step()
    runtime.setup(model, CPU, lambda: 0)
    assert runtime.per_rank == [0] and runtime.auto_choice is not None and runtime.auto_probe_seconds > 0
    assert runtime.auto_choice.lines[0].startswith("rank 0: tier 0; step ")
    assert runtime.tier_of(0) == 0 and runtime.layout is not None


def test_an_impossible_fit_fails_at_setup_naming_the_rank_and_numbers():
    model = _model(width=64)
    settings = MatFormerSettings(tiers="auto", auto_tiers=AutoTierSettings(memory_limit_bytes=[1024], probe_repeats=1))
    runtime = MatFormerRuntime(settings)
    runtime.auto_probe = _step()
    with pytest.raises(
        ValueError, match=r"no rank fits tier 0.*rank 0 \(limit 1024 B.*not probed.*Fix: give rank 0 more"
    ):
        runtime.setup(model, CPU, lambda: 0)
    assert find_ffns(model)[0].width == 64  # nothing was sliced


def test_no_probe_batch_fails_naming_the_fix():
    runtime = MatFormerRuntime(MatFormerSettings(tiers="auto"))
    with pytest.raises(ValueError, match="needs a probe batch.*Pass explicit tiers instead"):
        runtime.setup(_model(), CPU, lambda: 0)


def test_candidates_must_divide_the_ffns():
    runtime = MatFormerRuntime(MatFormerSettings(tiers="auto", auto_tiers=AutoTierSettings(candidates=[0, 7])))
    runtime.auto_probe = _step()
    with pytest.raises(ValueError, match=r"auto_tiers.candidates=\[0, 7\]: tier\(s\) \[7\]"):
        runtime.setup(_model(width=64), CPU, lambda: 0)


# ------------------------------------------------------------------------------------------------ callbacks
def _trainer(settings: MatFormerSettings, chosen: list | None) -> SimpleNamespace:
    return SimpleNamespace(strategy=SimpleNamespace(settings=settings, tiers=chosen), callbacks=[])


def test_callbacks_read_candidates_before_the_choice_and_the_chosen_tiers_after():
    settings = MatFormerSettings(tiers="auto", auto_tiers=AutoTierSettings(candidates=[0, 1, 2]))
    assert callback_tiers("TierExport", None, _trainer(settings, None)) == [0, 1, 2]
    assert callback_tiers("TierExport", None, _trainer(settings, [0, 2, 2])) == [0, 2]
    assert callback_tiers("TierExport", [0, 1, 2], _trainer(settings, [0, 2])) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"TierExport\(tiers=\[0, 1\]\) leaves out tier\(s\) \[2\]"):
        callback_tiers("TierExport", [0, 1], _trainer(settings, [0, 2]))
    with pytest.raises(ValueError, match="per-FFN tiers"):
        callback_tiers("TierEvaluation", None, _trainer(settings, [0, [0, 1]]))
