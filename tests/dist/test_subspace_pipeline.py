"""The subspace pipeline runtime on spawned gloo ranks: exact parity with one process, exact ledger bytes.

Each worker builds the same seeded tiny Llama, keeps only its own stage and runs GPipe and 1F1B steps through
:class:`~lightning_hetero.subspace_pipeline.runtime.SubspacePipelineRuntime`. The parent runs the independent reference:
the whole constrained model as ONE module (``constrained_model``, no boundary encode/decode) or the unmodified HF model
(``compress=False``), and compares the loss and every stage parameter's gradient to 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero import comm
from lightning_hetero.pipeline.settings import PipelineSettings
from lightning_hetero.subspace_pipeline.runtime import SubspacePipelineRuntime
from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings
from lightning_hetero.testing import run_distributed

VOCAB, HIDDEN, K, SEQ, BATCH = 64, 32, 8, 12, 8
TOL = 1e-5


def _hf_model(num_layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _batch(seed: int = 3) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, 5:] = -100  # some ignored labels: the loss must weigh microbatches by their valid tokens
    return {"input_ids": ids, "labels": labels}


def _reference(run: dict[str, Any], num_stages: int, batches: list[dict[str, torch.Tensor]]) -> tuple[float, dict]:
    """Loss and gradients of the same model in one process: mean over replicas of the full-batch token-mean loss."""
    from lightning_hetero.subspace_pipeline.basis import SubspaceConfig
    from lightning_hetero.subspace_pipeline.stages import causal_lm_loss, constrained_model

    hf = _hf_model()
    if run.get("compress", True):
        model: nn.Module = constrained_model(
            hf, SubspaceConfig(subspace_dim=K, mode=run.get("mode", "reparam")), num_stages
        )
        forward = lambda ids: model(None, ids)  # noqa: E731
    else:
        model = hf
        forward = lambda ids: model(input_ids=ids).logits  # noqa: E731
    total = 0.0
    for batch in batches:
        loss = causal_lm_loss(forward(batch["input_ids"]), batch["labels"]) / len(batches)
        loss.backward()
        total += loss.item()
    if run.get("mode") == "projected":
        model.project_gradients_()  # the runtime projects after backward, as the optimizer step needs
    return total, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _pipeline_worker(rank: int, world_size: int, num_stages: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every run config: one training step; returns loss, gradients and this rank's pipeline ledger records."""
    results = []
    dp = world_size // num_stages
    for run in runs:
        options = {"subspace_dim": K, **run}
        codec = options.pop("boundary_dtype", "fp32")
        pipeline = PipelineSettings(num_stages=num_stages, data_parallel_size=dp, boundary_dtype=codec)
        runtime = SubspacePipelineRuntime(
            SubspacePipelineSettings(pipeline=pipeline, n_microbatches=4, seed=0, **options)
        )
        holder = nn.Module()
        holder.model = _hf_model()
        runtime.setup(holder, torch.device("cpu"), rank)
        with comm.get_ledger().capture() as view:
            loss = runtime.train_step(_batch(seed=3 + runtime.dp_rank), holder)
        stage = runtime.stage
        records = [(r.op, r.label, r.payload_bytes) for r in view.records()]
        results.append(
            {
                "stage": runtime.stage_index,
                "loss": loss.item(),
                "grads": {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None},
                "records": records,
                "boundary_bytes": stage.boundary_bytes(BATCH // 4, SEQ),
            }
        )
    return results


def _update_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Two AdamW steps with a subspace update after each; then the basis, an eval loss and (rank 0) all stage states."""
    runtime = SubspacePipelineRuntime(
        SubspacePipelineSettings(subspace_dim=K, n_microbatches=2, update_every=1, update_lr=0.5)
    )
    holder = nn.Module()
    holder.model = _hf_model()
    runtime.setup(holder, torch.device("cpu"), rank)
    initial = runtime.stage.basis.clone()
    optimizer = torch.optim.AdamW(runtime.stage.parameters(), lr=1e-2)
    with comm.get_ledger().capture() as view:
        for step in (1, 2):
            runtime.train_step(_batch(seed=10 + step), holder)
            optimizer.step()
            optimizer.zero_grad()
            assert runtime.after_optimizer_step(optimizer, step)
    return {
        "initial": initial,
        "basis": runtime.stage.basis.clone(),
        "loss": runtime.eval_step(_batch(seed=20), holder).item(),
        "states": runtime.gather_stage_states(),
        "collectives": [(r.op, r.payload_bytes) for r in view.records() if r.op in ("all_reduce", "broadcast")],
    }


def _check_update(results: list[dict[str, Any]]) -> None:
    """Bit-identical U on both stages, moved by the update; the pipeline still equals one process (exact boundary)."""
    from lightning_hetero.subspace_pipeline.basis import SubspaceConfig
    from lightning_hetero.subspace_pipeline.stages import causal_lm_loss, constrained_model

    stage0, stage1 = results
    assert torch.equal(stage0["basis"], stage1["basis"])
    assert (stage0["basis"] - stage0["initial"]).abs().max() > 1e-3  # the update moved U
    merged = {**stage0["states"][0], **stage0["states"][1]}
    assert torch.equal(stage0["states"][0]["subspace.basis"], stage0["states"][1]["subspace.basis"])
    reference = constrained_model(_hf_model(), SubspaceConfig(subspace_dim=K, update_every=1), 2)
    reference.load_state_dict(merged, strict=True)
    with torch.no_grad():
        batch = _batch(seed=20)
        expected = causal_lm_loss(reference(None, batch["input_ids"]), batch["labels"]).item()
    assert abs(stage0["loss"] - expected) < TOL and stage0["loss"] == stage1["loss"], (stage0["loss"], expected)
    # per update: the d x k statistic summed over both ranks, then U broadcast from rank 0 (plus loss broadcasts)
    statistic = HIDDEN * K * 4
    assert [b for op, b in stage0["collectives"] if op == "all_reduce"] == [statistic, statistic]
    assert [b for op, b in stage0["collectives"] if op == "broadcast" and b == statistic] == [statistic, statistic]


def _check_parity(results: list[list[dict]], runs: list[dict], num_stages: int, dp: int) -> None:
    for index, run in enumerate(runs):
        if run.get("boundary_dtype", "fp32") != "fp32":
            continue
        batches = [_batch(seed=3 + d) for d in range(dp)]
        loss, grads = _reference(run, num_stages, batches)
        seen: set[str] = set()
        for rank_results in results:
            got = rank_results[index]
            if dp == 1:
                assert abs(got["loss"] - loss) < TOL, (run, got["loss"], loss)
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, grads[name], rtol=0, atol=TOL, msg=f"{run} {name}")
                seen.add(name)
        assert seen == set(grads), (run, set(grads) ^ seen)  # every parameter's gradient is checked once per stage


def _check_ledger(results: list[list[dict]], runs: list[dict], num_stages: int) -> None:
    """Per boundary and microbatch: exactly one message of B*S*k*bytes each way, nothing else on p2p."""
    for index, run in enumerate(runs):
        for rank_results in results:
            got = rank_results[index]
            stage, size = got["stage"], got["boundary_bytes"]
            p2p = [(op, b) for op, label, b in got["records"] if label == comm.PIPELINE and op in ("isend", "recv")]
            sends = [b for op, b in p2p if op == "isend"]
            receives = [b for op, b in p2p if op == "recv"]
            expected_messages = 4 * ((stage > 0) + (stage < num_stages - 1))  # 4 microbatches, per neighbour
            assert len(sends) == len(receives) == expected_messages, (run, stage, p2p)
            assert set(sends) | set(receives) == {size}, (run, stage, p2p)
            assert all(label == comm.PIPELINE for _, label, _ in got["records"] if _ in ("isend", "recv")), run


RUNS_2 = [
    {"schedule": "gpipe"},
    {"schedule": "1f1b"},
    {"schedule": "1f1b", "mode": "projected"},
    {"schedule": "1f1b", "compress": False, "subspace_dim": None},
    {"schedule": "gpipe", "boundary_dtype": "bf16"},  # ledger only (bf16 coordinates are not bit-exact)
]


def _two_stage_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Every 2-stage check in one spawn (start-up dominates): the run configs, then the subspace update."""
    return {"runs": _pipeline_worker(rank, world_size, 2, RUNS_2), "update": _update_worker(rank, world_size)}


@pytest.fixture(scope="module")
def two_stage_results() -> list[dict[str, Any]]:
    return run_distributed(_two_stage_worker, 2, timeout=170)


@pytest.mark.timeout(180)
def test_subspace_update_keeps_every_stage_on_one_basis_and_exact(two_stage_results):
    _check_update([result["update"] for result in two_stage_results])


@pytest.mark.timeout(180)
def test_two_stages_match_one_process_and_bytes_are_exact(two_stage_results):
    results = [result["runs"] for result in two_stage_results]
    _check_parity(results, RUNS_2, num_stages=2, dp=1)
    _check_ledger(results, RUNS_2, num_stages=2)
    fp32 = results[0][0]["boundary_bytes"]
    assert fp32 == (BATCH // 4) * SEQ * K * 4  # mb * S * k * 4 bytes
    assert results[0][3]["boundary_bytes"] == (BATCH // 4) * SEQ * HIDDEN * 4  # compress=False: d numbers
    assert results[0][4]["boundary_bytes"] == (BATCH // 4) * SEQ * K * 2  # bf16 coordinates: 2 bytes each


RUNS_4 = [{"schedule": "gpipe"}, {"schedule": "1f1b"}, {"schedule": "gpipe", "compress": False, "subspace_dim": None}]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_stages_match_one_process_and_bytes_are_exact():
    results = run_distributed(_pipeline_worker, 4, 4, RUNS_4, timeout=280)
    _check_parity(results, RUNS_4, num_stages=4, dp=1)
    _check_ledger(results, RUNS_4, num_stages=4)


RUNS_DP = [{"schedule": "1f1b"}]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_replicas_of_two_stages_average_gradients():
    """Replica d reads batch d; every stage's gradient equals the one-process gradient of the mean loss."""
    results = run_distributed(_pipeline_worker, 4, 2, RUNS_DP, timeout=280)
    _check_parity(results, RUNS_DP, num_stages=2, dp=2)
    for replica0, replica1 in ((results[0], results[1]), (results[2], results[3])):  # ranks 0,1: stage 0
        assert replica0[0]["stage"] == replica1[0]["stage"]
        for name, grad in replica0[0]["grads"].items():
            assert torch.equal(grad, replica1[0]["grads"][name]), name
