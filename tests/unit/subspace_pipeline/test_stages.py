"""Stage modules: exact reconstruction at every boundary, parity with the whole model and with plain HF, errors."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from lightning_hetero.hf.decoder import find_decoder
from lightning_hetero.pipeline.layout import split_layers
from lightning_hetero.subspace_pipeline import (
    StageModule,
    SubspaceConfig,
    build_stages,
    causal_lm_loss,
    constrained_model,
    outside_span_fraction,
    reference_forward,
)
from tests.unit.subspace_pipeline._tiny import (
    FAMILIES,
    LAYERS,
    chain_with_messages,
    fresh,
    relative_error,
    tiny_model,
    token_ids,
)

K = 8


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["reparam", "projected"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_reconstruction_is_exact_at_every_boundary_forward_and_backward(mode: str, num_stages: int) -> None:
    """fp32: the residual rebuilt from k coordinates equals the sender's, and the k-dim gradient message equals
    (dL/dh) U computed independently at the receiver."""
    config = SubspaceConfig(subspace_dim=K, mode=mode)
    stages = build_stages(tiny_model(), config, num_stages, list(range(num_stages)))
    ids = token_ids()
    x = None
    for sender, receiver in zip(stages[:-1], stages[1:], strict=True):
        hidden = sender.embed(ids) if sender.is_first else sender.subspace.decode(x, ids)
        hidden = sender.run_layers(hidden).detach()
        wire = sender(x, ids)
        assert wire.shape == (2, 12, K) == sender.boundary_shape(2, 12)
        rebuilt = receiver.subspace.decode(receiver.codec.decode(wire, torch.float32), ids)
        assert relative_error(rebuilt, hidden) < 1e-5

        # backward: gradient of the received coordinates vs (dL/dh) U at the rebuilt residual
        received = wire.detach().requires_grad_(True)
        loss = causal_lm_loss(reference_forward_from(stages, receiver, received, ids), ids)
        (message,) = torch.autograd.grad(loss, received)
        residual = rebuilt.detach().requires_grad_(True)
        loss_h = causal_lm_loss(reference_forward_from(stages, receiver, residual, ids, decoded=True), ids)
        (grad_h,) = torch.autograd.grad(loss_h, residual)
        assert message.shape == (2, 12, K)
        assert relative_error(message, grad_h @ receiver.basis) < 1e-5
        x = wire.detach()


def reference_forward_from(stages, first, tensor, ids, decoded: bool = False):
    """Run ``first`` and the stages after it on ``tensor`` (a wire tensor, or an already rebuilt residual)."""
    out = None
    for stage in stages[stages.index(first) :]:
        if out is None and decoded:
            hidden = stage.run_layers(tensor)
            out = (
                stage.lm_head(stage.model.norm(hidden))
                if stage.is_last
                else stage.codec.encode(stage.subspace.encode(hidden, ids))
            )
        else:
            out = stage(tensor if out is None else out, ids)
    return out


def test_unconstrained_layer_breaks_reconstruction() -> None:
    """Negative control: after a free (last-stage) layer the residual is NOT in span(U), so the same check fails."""
    stages = build_stages(tiny_model(), SubspaceConfig(subspace_dim=K), 2, [0, 1])
    ids = token_ids()
    first, last = stages
    hidden = last.run_layers(last.subspace.decode(first(None, ids), ids)).detach()
    rebuilt = last.subspace.decode(last.subspace.encode(hidden, ids), ids)
    assert relative_error(rebuilt, hidden) > 0.1


@pytest.mark.parametrize("mode", ["reparam", "projected"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_chained_stages_equal_whole_constrained_model(mode: str, num_stages: int) -> None:
    """float64 weights, fp32 wire: logits and every parameter gradient agree to 1e-6."""
    model = tiny_model(dtype=torch.float64)
    config = SubspaceConfig(subspace_dim=K, mode=mode)
    whole = constrained_model(fresh(model), config, num_stages)
    stages = build_stages(fresh(model), config, num_stages, list(range(num_stages)))
    ids = token_ids()
    logits, loss, _ = chain_with_messages(stages, ids)
    whole_logits = reference_forward(whole, ids)
    causal_lm_loss(whole_logits, ids).backward()
    # Projected mode: the raw gradient of a dense confined weight differs (the pipeline never sees the part of dL/dh
    # outside span(U)); the gradient on the constraint set -- the projected one the optimizer uses -- is identical.
    for module in (whole, *stages):
        module.project_gradients_()
    assert relative_error(logits, whole_logits) < 1e-6
    assert torch.allclose(reference_forward(stages, ids), whole_logits, rtol=0, atol=1e-6)
    whole_grads = _grads(whole)
    stage_grads = {name: g for stage in stages for name, g in _grads(stage).items()}
    assert set(stage_grads) == set(whole_grads)
    for name, grad in whole_grads.items():
        assert relative_error(stage_grads[name], grad) < 1e-6, name
    # the constraint is where it should be: layers of every stage but the last
    last_start = split_layers(LAYERS, num_stages)[-1][0]
    assert whole.constrained_layers == tuple(range(last_start))


@pytest.mark.parametrize("num_stages", [2, 4])
def test_compress_false_equals_unmodified_hf_model(num_stages: int) -> None:
    model = tiny_model()
    stages = build_stages(fresh(model), SubspaceConfig(compress=False), num_stages, list(range(num_stages)))
    ids = token_ids()
    logits, _, received = chain_with_messages(stages, ids)
    assert received[0].shape == (2, 12, 64)  # the boundary carries d numbers
    hf_logits = model(ids).logits
    causal_lm_loss(hf_logits, ids).backward()
    assert torch.equal(logits, hf_logits)
    hf_grads = _grads(model)
    stage_grads = {name: g for stage in stages for name, g in _grads(stage).items()}
    assert set(stage_grads) == set(hf_grads)  # same FQNs as the HF model
    for name, grad in hf_grads.items():
        torch.testing.assert_close(stage_grads[name], grad, rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_supported_family_reconstructs_and_matches_hf(family: str) -> None:
    model = tiny_model(family, dtype=torch.float64)
    ids = token_ids(seq=12)
    config = SubspaceConfig(subspace_dim=K)
    stages = build_stages(fresh(model), config, 2, [0, 1])
    whole = constrained_model(fresh(model), config, 2)
    # fp32 wire, float64 weights: agreement to the wire's rounding (norm-relative)
    assert relative_error(reference_forward(stages, ids), reference_forward(whole, ids)) < 1e-6
    plain = build_stages(fresh(model), SubspaceConfig(compress=False), 2, [0, 1])
    assert relative_error(reference_forward(plain, ids), model(ids).logits) < 1e-6


def test_padding_mask_matches_hf() -> None:
    model = tiny_model()
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    plain = build_stages(fresh(model), SubspaceConfig(compress=False), 2, [0, 1])
    out = plain[1](plain[0](None, ids, mask), ids, mask)
    torch.testing.assert_close(out, model(ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-6)


def test_constrained_weights_and_embedding_lie_in_span() -> None:
    whole = constrained_model(tiny_model(), SubspaceConfig(subspace_dim=K, mode="projected"), 2)
    u = whole.basis
    for index in (0, 1):
        layer = whole.model.layers[str(index)]
        assert outside_span_fraction(layer.self_attn.o_proj.weight, u, 0) < 1e-6
        assert outside_span_fraction(layer.mlp.down_proj.weight, u, 0) < 1e-6
    assert outside_span_fraction(whole.model.embed_tokens.weight_in_span, u, 1) < 1e-6
    assert outside_span_fraction(whole.model.layers["3"].self_attn.o_proj.weight, u, 0) > 0.5  # last stage free


def test_stage_holds_only_its_own_pieces_and_keeps_hf_names() -> None:
    model = tiny_model()
    hf_names = set(dict(model.named_parameters()))
    stages = build_stages(model, SubspaceConfig(subspace_dim=K), 2, [1], release_unused=True)
    (stage,) = stages
    names = set(stage.state_dict())
    assert {"lm_head.weight", "model.norm.weight", "model.layers.2.self_attn.q_proj.weight"} <= names
    assert not any(name.startswith(("model.layers.0.", "model.layers.1.", "model.embed_tokens")) for name in names)
    assert {"subspace.basis", "subspace.accumulated", "subspace.fixed._extra_state"} <= names
    assert all(name in hf_names for name in names if not name.startswith("subspace."))
    # the other stage's modules were released to the meta device
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta
    assert not model.model.layers[2].self_attn.q_proj.weight.is_meta


def test_stage_state_dict_round_trip_and_bit_identical_ranks() -> None:
    config = SubspaceConfig(subspace_dim=K, seed=7)
    a = build_stages(tiny_model(seed=0), config, 2, [0])[0]
    b = build_stages(tiny_model(seed=0), config, 2, [0])[0]  # "another rank": same seed -> identical
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    other = build_stages(tiny_model(seed=3), SubspaceConfig(subspace_dim=K, seed=1), 2, [0])[0]
    other.load_state_dict(a.state_dict())
    ids = token_ids()
    assert torch.equal(other(None, ids), a(None, ids))  # includes T_fixed regenerated from the restored seed


def test_tied_embeddings_are_untied() -> None:
    model = tiny_model(tie_word_embeddings=True)
    parts = find_decoder(model)
    assert parts.tied
    stages = build_stages(fresh(model), SubspaceConfig(compress=False), 2, [0, 1])
    assert stages[1].lm_head.weight is not stages[0].model.embed_tokens.weight
    torch.testing.assert_close(reference_forward(stages, token_ids()), model(token_ids()).logits)


def test_errors_are_clear() -> None:
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16))
    with pytest.raises(ValueError, match="found: .*GPT2LMHeadModel.*supports LlamaForCausalLM, MistralForCausalLM"):
        build_stages(gpt2, SubspaceConfig(subspace_dim=4), 2, [0])
    with pytest.raises(ValueError, match="both of subspace_dim and dim_ratio"):
        SubspaceConfig(subspace_dim=4, dim_ratio=8.0)
    with pytest.raises(ValueError, match="neither of subspace_dim and dim_ratio"):
        SubspaceConfig()
    with pytest.raises(ValueError, match="subspace_dim=65 exceeds the model width d=64"):
        build_stages(tiny_model(), SubspaceConfig(subspace_dim=65), 2, [0])
    with pytest.raises(ValueError, match="num_stages=5 exceeds"):
        build_stages(tiny_model(), SubspaceConfig(subspace_dim=4), 5, [0])
    with pytest.raises(ValueError, match="stage_indices"):
        build_stages(tiny_model(), SubspaceConfig(subspace_dim=4), 2, [2])
    with pytest.raises(ValueError, match="mode='lowrank'"):
        SubspaceConfig(subspace_dim=4, mode="lowrank")
    with pytest.raises(ValueError, match="coord_dtype='fp8'"):
        SubspaceConfig(subspace_dim=4, coord_dtype="fp8")
    stage = build_stages(tiny_model(), SubspaceConfig(subspace_dim=4), 2, [1])[0]
    with pytest.raises(ValueError, match="not the first stage"):
        stage(None, token_ids())
    model = tiny_model()
    constrained_model(model, SubspaceConfig(subspace_dim=4), 2)
    with pytest.raises(ValueError, match="already confined"):
        constrained_model(model, SubspaceConfig(subspace_dim=4), 2)


def test_dim_ratio_resolves_the_subspace_dim() -> None:
    assert SubspaceConfig(dim_ratio=16).resolve_subspace_dim(64) == 4
    stage = build_stages(tiny_model(), SubspaceConfig(dim_ratio=8), 2, [0])[0]
    assert stage.subspace_dim == 8 and stage.basis.shape == (64, 8)
    assert isinstance(stage, StageModule) and stage.is_first and not stage.is_last
