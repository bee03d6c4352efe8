"""predict_step of each reference module returns per-example tensors with known meaning."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.models import CausalLMModule, ImageClassifierModule, Seq2SeqModule

from .helpers import image_batch, seq2seq_batch, token_batch

pytestmark = pytest.mark.filterwarnings("ignore:.*self.trainer.*:UserWarning")


def _built(module):
    module.configure_model()
    module.eval()
    return module


@torch.no_grad()
def test_causal_lm_sequence_nll_averages_to_the_hf_loss_and_next_token_skips_padding() -> None:
    module = _built(CausalLMModule())
    batch = token_batch(vocab_size=2048, batch_size=3, length=12, pad=3)
    out = module.predict_step(batch, 0)
    assert out["sequence_nll"].shape == (3,) and out["next_token"].shape == (3,)
    # Equal non-pad counts per row, so the mean of per-sequence NLLs is the HF loss.
    torch.testing.assert_close(out["sequence_nll"].mean(), module(**batch).loss)
    logits = module(**batch).logits
    torch.testing.assert_close(out["next_token"], logits[:, 12 - 3 - 1].argmax(-1))


@torch.no_grad()
def test_image_classifier_predictions_are_the_argmax_of_probabilities() -> None:
    module = _built(ImageClassifierModule())
    batch = image_batch(batch_size=5)
    out = module.predict_step(batch, 0)
    torch.testing.assert_close(out["probabilities"].sum(-1), torch.ones(5))
    torch.testing.assert_close(out["predictions"], module(**batch).logits.argmax(-1))


@torch.no_grad()
def test_seq2seq_generates_greedily_up_to_the_label_length() -> None:
    module = _built(Seq2SeqModule())
    batch = seq2seq_batch(vocab_size=2048, batch_size=2, target=7)
    generated = module.predict_step(batch, 0)["generated"]
    assert generated.shape[0] == 2 and 1 < generated.shape[1] <= 1 + 7
    assert torch.all(generated[:, 0] == module.model.config.decoder_start_token_id)
