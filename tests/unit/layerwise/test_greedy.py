"""GreedyStages: what trains when, exact activation caching, export and checkpoint state."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from lightning_hetero.layerwise import ActivationCache, GreedyStages, SplitMismatchError, split_into_blocks
from tests.unit.layerwise.helpers import tiny_batch, tiny_model


def _train(stages: GreedyStages, family: str, steps: int = 3, with_index: bool = False) -> None:
    """Every stage, ``steps`` AdamW steps on batches of changing size and order (index-keyed if asked)."""
    data = tiny_batch(family, rows=12, seed=1)
    order = torch.Generator().manual_seed(0)
    for stage in range(stages.num_stages):
        stages.enter_stage(stage)
        optimizer = torch.optim.AdamW(stages.active_parameters(), lr=1e-2)
        for step in range(steps):
            rows = torch.randperm(12, generator=order)[: 4 + 2 * (step % 2)]
            batch = {key: value[rows] for key, value in data.items()}
            if with_index:
                batch["index"] = rows
            optimizer.zero_grad()
            stages.stage_loss(batch).backward()
            optimizer.step()


def _stages(model: torch.nn.Module, **kwargs) -> GreedyStages:
    torch.manual_seed(7)  # the auxiliary heads' initialisation draws from the global generator
    return GreedyStages(split_into_blocks(model), **kwargs)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.mark.parametrize("family", ["vit", "gpt2", "cnn"])
def test_each_stage_trains_only_its_block_and_head(family):
    model = tiny_model(family)
    stages = GreedyStages(split_into_blocks(model))
    stack = stages.stack
    for stage in range(stages.num_stages):
        stages.enter_stage(stage)
        before = copy.deepcopy(model.state_dict())
        optimizer = torch.optim.SGD(stages.active_parameters(), lr=0.1)
        stages.stage_loss(tiny_batch(family)).backward()
        optimizer.step()
        changed = {name for name, value in model.state_dict().items() if not torch.equal(value, before[name])}

        def names_of(module):  # tied weights (GPT-2's lm_head is wte) appear under both names in the state dict
            owned = list(module.parameters())
            return {n for n, p in model.named_parameters(remove_duplicate=False) if any(p is q for q in owned)}

        block_names = names_of(stack.blocks[stage])
        allowed = block_names | names_of(stages.head(stage)) | (names_of(stack.stem) if stage == 0 else set())
        assert changed and changed <= allowed, (stage, sorted(changed - allowed))
        assert block_names & changed  # the block itself learned
        frozen = [p for m in stages.frozen_modules(stage) for p in m.parameters()]
        assert not any(p.requires_grad for p in frozen)


def test_gpt2_tied_lm_head_stays_frozen_after_stage_zero():
    model = tiny_model("gpt2")
    stages = GreedyStages(split_into_blocks(model))
    stages.enter_stage(2)  # the last stage trains through the model's own head, whose weight is the embedding
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not model.lm_head.weight.requires_grad
    assert all(p.requires_grad for p in model.transformer.ln_f.parameters())


@pytest.mark.parametrize("storage", ["memory", "disk"])
@pytest.mark.parametrize("with_index", [True, False])
def test_cached_run_equals_uncached_run_bit_for_bit(tmp_path, storage, with_index):
    base = tiny_model("vit")
    reference = copy.deepcopy(base)
    _train(_stages(reference), "vit")
    cache = ActivationCache(storage, directory=tmp_path)
    cached = copy.deepcopy(base)
    _train(_stages(cached, cache=cache), "vit", with_index=with_index)
    assert _same_weights(reference, cached)
    assert cache.hits > 0 and cache.stats()["entries"] > 0
    if storage == "disk":
        assert list(tmp_path.glob("level_*/*.safetensors"))


def test_cache_promotes_one_block_from_the_previous_level():
    model = tiny_model("llama")
    cache = ActivationCache()
    stages = GreedyStages(split_into_blocks(model), cache=cache)
    batch = tiny_batch("llama")
    stages.enter_stage(1)
    level_one = stages.stage_input(batch)
    stages.enter_stage(2)
    calls = []
    hook = stages.stack.blocks[0].register_forward_hook(lambda *args: calls.append(1))
    level_two = stages.stage_input(batch)
    hook.remove()
    assert not calls  # block 0 was not run again: its output came from the cache
    context = stages.stack.context_of(batch)
    with torch.no_grad():
        assert torch.equal(level_two, stages.stack.blocks[1].eval()(level_one, context))


def test_full_cache_falls_back_to_recomputing_and_logs_once(caplog):
    base = tiny_model("cnn")
    reference = copy.deepcopy(base)
    _train(_stages(reference), "cnn")
    limited = copy.deepcopy(base)
    cache = ActivationCache(max_bytes=5 * 4 * 14 * 14 * 4)  # five level-1 rows (4 channels, 14x14, float32)
    with caplog.at_level(logging.WARNING, logger="lightning_hetero.layerwise.cache"):
        _train(_stages(limited, cache=cache), "cnn")
    assert _same_weights(reference, limited)
    assert cache.refused > 0 and cache.bytes_used <= cache.max_bytes
    assert sum("activation cache full" in r.message for r in caplog.records) == 1


def test_cache_arguments_are_checked():
    with pytest.raises(ValueError, match="needs a directory"):
        ActivationCache("disk")
    with pytest.raises(ValueError, match="is not one of"):
        ActivationCache("gpu")
    with pytest.raises(ValueError, match="max_bytes=-1"):
        ActivationCache(max_bytes=-1)


@pytest.mark.parametrize("family", ["vit", "llama"])
def test_keep_last_aux_exports_it_as_the_models_head(family):
    model = tiny_model(family)
    kind = "lm_head" if family == "llama" else "linear"
    stages = GreedyStages(split_into_blocks(model), aux_head=kind, keep_last_aux=True)
    _train(stages, family, steps=2)
    batch = tiny_batch(family)
    with torch.no_grad(), torch.inference_mode(False):
        model.eval()
        stages.stack.blocks.eval()
        expected = stages.stage_logits(batch)  # last block through the last aux head
        stages.export_()
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        assert torch.allclose(model(**inputs).logits, expected, atol=1e-6, rtol=0)
    assert all(p.requires_grad for p in model.parameters())


def test_keep_last_aux_with_a_head_of_another_layout_fails_before_training():
    with pytest.raises(ValueError, match="keep_last_aux_head=True needs the last auxiliary head"):
        GreedyStages(split_into_blocks(tiny_model("vit")), aux_head="mlp", keep_last_aux=True)
    with pytest.raises(ValueError, match="keep_last_aux_head=True"):
        GreedyStages(split_into_blocks(tiny_model("cnn")), aux_head="linear", keep_last_aux=True)


def test_state_round_trip_and_split_mismatch():
    model = tiny_model("vit")
    stages = GreedyStages(split_into_blocks(model))
    _train(stages, "vit", steps=1)
    stages.enter_stage(1)
    state = stages.state_dict()
    restored = GreedyStages(split_into_blocks(copy.deepcopy(model)))
    restored.load_state_dict(state)
    assert restored.stage == 1
    assert _same_weights(restored.aux_heads, stages.aux_heads)
    other = GreedyStages(split_into_blocks(copy.deepcopy(model), num_blocks=2))
    with pytest.raises(SplitMismatchError, match="split 'vit:3:0-1,1-2,2-3'.*configured with split 'vit:3:0-2,2-3'"):
        other.load_state_dict(state)
