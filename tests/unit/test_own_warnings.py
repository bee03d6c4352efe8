"""A clean run warns nothing of our own: a tiny fit of each strategy (and the callbacks) in-process on 1 device.

Every warning (``warnings`` and WARNING log records of transformers, torch, Lightning and ``lightning_hetero``) is
recorded with the stack it was raised from. It is ours when the first frame outside the libraries (torch,
transformers, Lightning) is in ``lightning_hetero``: raised by our code, or by a library we called (a deprecated
argument we pass). Lightning's metric warnings are raised later, at the epoch's end, with no frame of ours on the
stack; they name the metric, so a warning naming a metric only we log counts too (``sync_dist`` advice for
``TierEvaluation``'s values). A user's own module and Lightning's own advice are not ours.
"""

from __future__ import annotations

import logging
import re
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist

from tests.usercode.cli_mynets import LitCNN, LitLlama

PACKAGE = str(Path(__file__).resolve().parents[2] / "lightning_hetero")
LIBRARIES = ("site-packages", "/lib/python3", "<frozen")
OUR_METRICS = re.compile(r"self\.log\('(val/(loss|perplexity)_tier|comm/|ft/|lowbit/|layerwise/|train/stage)")
LOGGERS = ("transformers", "torch", "lightning", "lightning.pytorch", "lightning_hetero")


def _caller(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame outside the libraries (and this file): who made the call that warned."""
    for frame in reversed(stack):
        if frame.filename == __file__ or any(part in frame.filename for part in LIBRARIES):
            continue
        return frame.filename
    return ""


@contextmanager
def _recorded() -> Iterator[list[tuple[str, str]]]:
    """``(message, caller file)`` of every warning and WARNING log record raised inside."""
    found: list[tuple[str, str]] = []

    def show(message: Any, category: type[Warning], filename: str, lineno: int, *args: Any) -> None:
        found.append((f"{category.__name__}: {message} ({filename}:{lineno})", _caller(traceback.extract_stack())))

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found.append((f"log {record.name}: {record.getMessage()}", _caller(traceback.extract_stack())))

    handler = Handler(level=logging.WARNING)
    for name in LOGGERS:
        logging.getLogger(name).addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            yield found
    finally:
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(handler)


def _fit(strategy: Any, module: L.LightningModule, callbacks: list[L.Callback] | None = None) -> None:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        limit_val_batches=1,
        val_check_interval=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks or [],
    )
    try:
        trainer.fit(module)
    finally:
        if dist.is_initialized():  # Lightning keeps its group after fit; the next fit must not find it
            dist.destroy_process_group()


def _one_stage(kind: str) -> Any:
    from lightning_hetero.pipeline.settings import PipelineSettings

    if kind == "layerwise":
        from lightning_hetero.layerwise.settings import LayerwiseSettings
        from lightning_hetero.strategies.layerwise.trainer import LayerwiseStrategy

        return LayerwiseStrategy(settings=LayerwiseSettings(pipeline=PipelineSettings(num_stages=1)))
    from lightning_hetero.strategies.subspace_pipeline.trainer import SubspacePipelineStrategy
    from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings

    return SubspacePipelineStrategy(settings=SubspacePipelineSettings(pipeline=PipelineSettings(num_stages=1)))


def _matformer_with_callbacks() -> None:
    from lightning_hetero.callbacks import CommunicationMonitor, ValidationReport
    from lightning_hetero.strategies.matformer.callbacks import TierEvaluation

    callbacks = [TierEvaluation(tiers=[0, 1]), ValidationReport(limit_batches=1), CommunicationMonitor()]
    _fit(_by_name("matformer"), LitLlama(), callbacks)


def _greedy_layerwise() -> None:
    from lightning_hetero.strategies.layerwise.callbacks import GreedyLayerwise

    _fit("auto", LitLlama(), [GreedyLayerwise(stage_steps=1, aux_head="lm_head")])


def _by_name(name: str) -> Any:
    """A strategy by the short name a YAML uses (registered by importing lightning_hetero)."""
    import lightning_hetero  # noqa: F401

    return name


RUNS: dict[str, Callable[[], None]] = {
    "flexdemo": lambda: _fit(_by_name("flexdemo"), LitLlama()),
    "matformer+callbacks": _matformer_with_callbacks,
    "sparseflip": lambda: _fit(_by_name("sparseflip"), LitCNN()),
    "subspace_pipeline": lambda: _fit(_one_stage("subspace_pipeline"), LitLlama()),
    "layerwise": lambda: _fit(_one_stage("layerwise"), LitLlama()),
    "greedy_layerwise": _greedy_layerwise,
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", list(RUNS))
def test_a_clean_run_raises_no_warning_of_ours(run):
    with _recorded() as found:
        RUNS[run]()
    ours = [message for message, caller in found if caller.startswith(PACKAGE) or OUR_METRICS.search(message)]
    assert not ours, "\n".join(ours)


def test_the_recorder_attributes_a_library_warning_to_the_caller_that_made_the_call():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=8)
    call = "create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=None)"
    scope = {"config": config, "embeds": torch.zeros(1, 3, 8)}
    exec("from transformers.masking_utils import create_causal_mask", scope)
    with _recorded() as found:
        exec(compile(call, f"{PACKAGE}/made_up.py", "exec"), scope)  # a deprecated argument, passed "by our code"
        exec(compile(call, __file__.replace(".py", "_user.py"), "exec"), scope)  # the same, by a user's file
    callers = [caller for message, caller in found if "past_key_values" in message]
    if not callers:
        pytest.skip("this transformers still takes past_key_values without a warning (4.x)")
    assert callers[0] == f"{PACKAGE}/made_up.py" and not callers[1].startswith(PACKAGE), found


def test_our_attention_masks_pass_the_cache_argument_by_its_current_name():
    from transformers import LlamaConfig

    from lightning_hetero.subspace_pipeline.stage_module import _attention_masks

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=8)
    with _recorded() as found:
        _attention_masks(config, torch.zeros(1, 3, 8), None, torch.arange(3)[None], {"full_attention"})
    assert not found, found
