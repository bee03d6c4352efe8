"""FlexDeMo's runtime on 4 spawned CPU ranks (gloo) = 2 simulated nodes x 2 ranks, on a tiny HF Llama.

One spawn runs every scenario (process start-up and the ``transformers`` import dominate on a small CPU box) and
returns what the tests assert on:

- ``FullReplicator`` + ``DecoupledAdamW`` (converted from torch AdamW) equals full-sync HSDP (FSDP2 on the 2-D mesh)
  + torch AdamW after 10 steps;
- every replicator keeps the replicas bit-identical for 20 steps under FSDP2 (shard size 2), while each rank trains
  on its own data, and the ``"inter"`` ledger payload of every step equals the replicator's ``payload_bytes``;
- resume from a per-rank checkpoint is bit-identical to an uninterrupted run (DeMo's error feedback, DiLoCo's
  anchors and outer momentum);
- accumulation (no launch on the first micro-batch) with activation checkpointing equals one big batch, and the
  overlap hooks launched every parameter during backward;
- node-norm clipping, the drift guard, and the degenerate layouts (shard size 1; one node).
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero import comm
from lightning_hetero.core.drift import ReplicaDriftError
from lightning_hetero.flexdemo.checkpoint import load_local_module_state, local_module_state
from lightning_hetero.flexdemo.runtime import FlexDeMoRuntime
from lightning_hetero.flexdemo.settings import FlexDeMoSettings
from lightning_hetero.flexdemo.sharding import local_tensor
from lightning_hetero.replication import ReplicationSettings
from lightning_hetero.testing import run_distributed
from tests.token_data import TINY_LLAMA, VOCAB

CONFIG = {**TINY_LLAMA, "tie_word_embeddings": False}
REPLICATORS = {
    "demo": ReplicationSettings(kind="demo", kept_fraction=1 / 8, chunk=8, values="bf16"),
    "random": ReplicationSettings(kind="random", kept_fraction=1 / 8),
    "striding": ReplicationSettings(kind="striding", kept_fraction=1 / 8),
    "diloco": ReplicationSettings(kind="diloco", sync_every=4),  # 20 steps end on a synchronisation
    "full": ReplicationSettings(kind="full"),
    "topk": ReplicationSettings(kind="topk", kept_fraction=1 / 8, chunk=8, values="sign"),
}
FULL = REPLICATORS["full"]
DEMO_1_32 = ReplicationSettings(kind="demo", chunk=8, values="bf16")  # demo at the default kept fraction


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _batch(rank: int, step: int, rows: int = 2) -> dict[str, torch.Tensor]:
    """Each rank's own batch (so replicas only stay equal if the exchange works)."""
    ids = torch.randint(0, VOCAB, (rows, 8), generator=torch.Generator().manual_seed(1000 * step + rank))
    return {"input_ids": ids, "labels": ids}


def _runtime(model: torch.nn.Module, optimizer: Any, **kwargs: Any) -> tuple[FlexDeMoRuntime, Any]:
    runtime = FlexDeMoRuntime(FlexDeMoSettings(**kwargs))
    runtime.resolve_world(4, 2)
    runtime.setup_module(model, torch.device("cpu"))
    return runtime, runtime.prepare_optimizer(optimizer(model.parameters()))


def _train(model: torch.nn.Module, runtime: FlexDeMoRuntime, optimizer: Any, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        runtime.before_step()
        loss = model(**_batch(rank, step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        runtime.after_step()
        losses.append(loss.item())
    return losses


def _shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: local_tensor(p).detach().clone() for name, p in model.named_parameters()}


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _parity(rank: int) -> float:
    """Full + DecoupledAdamW against HSDP (2-D mesh: reduce-scatter in the node, all-reduce across) + torch AdamW."""
    ours, reference = _model(), _model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in reference.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(reference, mesh=mesh)
    reference_optimizer = _adamw(reference.parameters())
    runtime, optimizer = _runtime(ours, _adamw, replication=FULL)
    assert type(optimizer).__name__ == "DecoupledAdamW"
    for step in range(10):
        reference(**_batch(rank, step)).loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    _train(ours, runtime, optimizer, rank, range(10))
    return max(
        (local_tensor(a) - local_tensor(b)).abs().max().item()
        for a, b in zip(ours.parameters(), reference.parameters(), strict=True)
    )


def _replicator_run(rank: int, name: str) -> dict[str, Any]:
    model = _model()
    runtime, optimizer = _runtime(model, _sgd, replication=REPLICATORS[name])
    shapes = [local_tensor(p).shape for group in optimizer.param_groups for p in group["params"]]
    measured, expected = [], []
    for step in range(20):
        with comm.get_ledger().capture() as seen:
            _train(model, runtime, optimizer, rank, range(step, step + 1))
        measured.append(sum(r.payload_bytes for r in seen.records() if r.label == comm.INTER))
        syncs = getattr(optimizer.replicator, "syncs_at", lambda s: True)(step)
        expected.append(optimizer.replicator.payload_bytes(shapes) if syncs else 0)
    stats = optimizer.comm_stats()
    return {"shards": _shards(model), "measured": measured, "expected": expected, "launched": stats["launched_early"]}


def _resume(rank: int, name: str) -> bool:
    def fresh() -> tuple[torch.nn.Module, FlexDeMoRuntime, Any]:
        model = _model()
        runtime, optimizer = _runtime(model, _sgd, replication=REPLICATORS[name])
        return model, runtime, optimizer

    straight, runtime, optimizer = fresh()
    _train(straight, runtime, optimizer, rank, range(6))
    first, runtime, optimizer = fresh()
    _train(first, runtime, optimizer, rank, range(3))
    buffer = io.BytesIO()
    torch.save({"model": local_module_state(first), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed, runtime, optimizer = fresh()
    load_local_module_state(resumed, saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    _train(resumed, runtime, optimizer, rank, range(3, 6))
    return all(
        torch.equal(local_tensor(a), local_tensor(b))
        for a, b in zip(straight.parameters(), resumed.parameters(), strict=True)
    )


def _accumulation(rank: int) -> dict[str, Any]:
    """Two micro-batches of one row (no launch on the first) with activation checkpointing vs one batch of two."""
    big, accumulated = _model(), _model()
    big_runtime, big_optimizer = _runtime(big, _adamw, replication=FULL)
    runtime, optimizer = _runtime(accumulated, _adamw, replication=FULL, activation_checkpointing=True)
    launched = []
    for step in range(3):
        batch = _batch(rank, step)
        big(**batch).loss.backward()
        big_optimizer.step()
        big_optimizer.zero_grad()
        for row in range(2):
            runtime.arm(row == 1)
            half = {key: value[row : row + 1] for key, value in batch.items()}
            (accumulated(**half).loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        runtime.after_step()
        launched.append(optimizer.comm_stats()["launched_early"])
    difference = max(
        (local_tensor(a) - local_tensor(b)).abs().max().item()
        for a, b in zip(big.parameters(), accumulated.parameters(), strict=True)
    )
    count = sum(1 for _ in accumulated.parameters())
    return {"difference": difference, "launched": launched, "params": count}


def _clipping(rank: int) -> dict[str, Any]:
    model = _model()
    runtime, optimizer = _runtime(model, _adamw, replication=FULL, overlap=False)
    model(**_batch(rank, 0)).loss.backward()
    reference = torch.linalg.vector_norm(torch.stack([p.grad.full_tensor().norm() for p in model.parameters()]))
    norm = runtime.clip_grad_norm_(model.parameters(), max_norm=0.1)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.full_tensor().norm() for p in model.parameters()]))
    optimizer.zero_grad()
    # With overlap on, clipping after a backward that already launched must refuse.
    overlapped = _model()
    overlapped_runtime, _ = _runtime(overlapped, _adamw, replication=FULL)
    overlapped(**_batch(rank, 0)).loss.backward()
    try:
        overlapped_runtime.clip_grad_norm_(overlapped.parameters(), max_norm=0.1)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    return {"norm": float(norm), "reference": float(reference), "clipped": float(clipped), "refused": refused}


def _drift(rank: int) -> str:
    model = _model()
    runtime, optimizer = _runtime(model, _sgd, replication=DEMO_1_32)
    _train(model, runtime, optimizer, rank, range(2))
    runtime.check_drift()  # fine so far
    if rank == 2:  # replica 1, shard position 0
        local_tensor(dict(model.named_parameters())["model.layers.1.mlp.up_proj.weight"]).data[0, 0] += 1e-3
    try:
        runtime.check_drift()
    except ReplicaDriftError as error:
        return str(error)
    return ""


def _degenerate(rank: int) -> dict[str, Any]:
    ddp_like = _model()
    runtime = FlexDeMoRuntime(FlexDeMoSettings(replication=DEMO_1_32, shard_size=1))
    runtime.resolve_world(4, 2)
    runtime.setup_module(ddp_like, torch.device("cpu"))
    optimizer = runtime.prepare_optimizer(_sgd(ddp_like.parameters()))
    _train(ddp_like, runtime, optimizer, rank, range(3))
    one_node = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        node_runtime = FlexDeMoRuntime(FlexDeMoSettings(replication=ReplicationSettings(kind="demo"), shard_size=4))
        node_runtime.resolve_world(4, 4)
        node_runtime.setup_module(one_node, torch.device("cpu"))
    node_optimizer = node_runtime.prepare_optimizer(_sgd(one_node.parameters()))
    losses = _train(one_node, node_runtime, node_optimizer, rank, range(2))
    return {
        "ddp_like": _shards(ddp_like),
        "ddp_like_sharded": runtime.sharded,
        "ddp_like_replicas": runtime.topology.num_replicas,
        "launched": optimizer.comm_stats()["launched_early"],
        "one_node_warning": [str(w.message) for w in caught if "single model copy" in str(w.message)],
        "one_node_local_rows": local_tensor(one_node.model.embed_tokens.weight).shape[0],
        "one_node_losses": losses,
    }


def _broadcast(rank: int) -> dict[str, torch.Tensor]:
    """Every rank initialises differently; after setup both replicas hold replica 0's shards."""
    torch.manual_seed(100 + rank)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    runtime = FlexDeMoRuntime(FlexDeMoSettings(replication=FULL))
    runtime.resolve_world(4, 2)
    runtime.setup_module(model, torch.device("cpu"))
    return _shards(model)


def _architectures(rank: int) -> dict[str, Any]:
    """GPT-2 (tied embeddings), T5 (two block stacks, shared embedding) and ViT: one sharded DeMo step each."""
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSeq2SeqLM

    from lightning_hetero.models.presets import build_config

    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(3, 200, (2, 8), generator=generator)
    cases = {
        "gpt2-tiny": (AutoModelForCausalLM, {"input_ids": tokens, "labels": tokens}),
        "t5-tiny": (AutoModelForSeq2SeqLM, {"input_ids": tokens, "labels": tokens}),
        "vit-tiny": (
            AutoModelForImageClassification,
            {"pixel_values": torch.randn(2, 1, 32, 32, generator=generator), "labels": torch.tensor([0, 1])},
        ),
    }
    out = {}
    for preset, (auto, batch) in cases.items():
        overrides = {"image_size": 32, "patch_size": 8, "num_labels": 2} if preset.startswith("vit") else {}
        torch.manual_seed(0)
        model = auto.from_config(build_config(preset, overrides))
        runtime, optimizer = _runtime(model, _sgd, replication=DEMO_1_32)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        out[preset] = {
            "blocks": runtime.block_source,
            "units": len(runtime.units),
            "finite": bool(torch.isfinite(loss)),
            "launched": optimizer.comm_stats()["launched_early"],
            "params": len(optimizer.param_groups[0]["params"]),
            "shards": _shards(model),
        }
    return out


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "broadcast": _broadcast(rank),
        "parity": _parity(rank),
        "replicators": {name: _replicator_run(rank, name) for name in REPLICATORS},
        "resume": {name: _resume(rank, name) for name in ("demo", "diloco")},
        "accumulation": _accumulation(rank),
        "clipping": _clipping(rank),
        "drift": _drift(rank),
        "degenerate": _degenerate(rank),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_scenarios, 4, timeout=600)


def _architecture_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    return {"architectures": _architectures(rank)}


@pytest.fixture(scope="module")
def architectures() -> list[dict[str, Any]]:
    return run_distributed(_architecture_scenarios, 4, timeout=600)


@pytest.mark.timeout(900)
def test_full_decoupled_adamw_matches_hsdp_adamw(results):
    for rank, result in enumerate(results):
        assert result["parity"] < 1e-6, (rank, result["parity"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(REPLICATORS))
def test_replicas_stay_bit_identical_and_ledger_matches_payload(results, name):
    for shard in range(2):  # ranks (0, 2) and (1, 3) hold the same shard on different nodes
        first, second = results[shard]["replicators"][name], results[shard + 2]["replicators"][name]
        for key, value in first["shards"].items():
            assert torch.equal(value, second["shards"][key]), (name, shard, key)
    for rank, result in enumerate(results):
        run = result["replicators"][name]
        assert run["measured"] == run["expected"], (name, rank)
        assert sum(run["measured"]) > 0
        assert run["launched"] == len(run["shards"]), (name, run["launched"])  # all launched during backward


@pytest.mark.timeout(900)
def test_replicas_do_not_match_without_exchange(results):
    """The bit-identity above is meaningful: the replicas' data differ, so their local shards would diverge."""
    assert not torch.equal(_batch(0, 0)["input_ids"], _batch(2, 0)["input_ids"])
    demo = results[0]["replicators"]["demo"]["shards"]
    full = results[0]["replicators"]["full"]["shards"]
    assert any(not torch.equal(demo[k], full[k]) for k in demo)  # and different replicators train differently


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["demo", "diloco"])
def test_resume_from_local_checkpoint_is_bit_identical(results, name):
    assert all(result["resume"][name] for result in results)


@pytest.mark.timeout(900)
def test_accumulation_launches_only_on_the_final_micro_batch(results):
    for result in results:
        accumulation = result["accumulation"]
        assert accumulation["difference"] < 1e-5
        assert accumulation["launched"] == [accumulation["params"]] * 3  # every parameter during the last backward


@pytest.mark.timeout(900)
def test_clipping_uses_the_node_norm_and_refuses_after_launch(results):
    for result in results:
        clipping = result["clipping"]
        assert clipping["norm"] == pytest.approx(clipping["reference"], rel=1e-5)
        assert clipping["clipped"] == pytest.approx(0.1, rel=1e-4)
        assert "overlap=False" in clipping["refused"]
    assert results[0]["clipping"]["norm"] == pytest.approx(results[1]["clipping"]["norm"], rel=1e-6)  # same node


@pytest.mark.timeout(900)
def test_drift_guard_names_step_ranks_and_parameter(results):
    for result in results:
        message = result["drift"]
        assert "optimizer step 2" in message
        assert "'model.layers.1.mlp.up_proj.weight'" in message
        assert "rank(s) [2]" in message and "rank 0" in message


@pytest.mark.timeout(900)
def test_initial_state_is_broadcast_from_the_first_replica(results):
    for shard in range(2):
        for name, value in results[shard]["broadcast"].items():
            assert torch.equal(value, results[shard + 2]["broadcast"][name]), name
    torch.manual_seed(100)
    own = LlamaForCausalLM(LlamaConfig(**CONFIG)).model.embed_tokens.weight
    torch.manual_seed(102)
    other = LlamaForCausalLM(LlamaConfig(**CONFIG)).model.embed_tokens.weight
    assert not torch.equal(own, other)  # the replicas really started from different weights


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("preset", ["gpt2-tiny", "t5-tiny", "vit-tiny"])
def test_other_architectures_shard_per_block_and_stay_replicated(architectures, preset):
    results = architectures
    for result in results:
        case = result["architectures"][preset]
        assert case["blocks"] == "_no_split_modules" and case["units"] > 2
        assert case["finite"] and case["launched"] == case["params"]  # every unit launched during backward
    for shard in range(2):
        for name, value in results[shard]["architectures"][preset]["shards"].items():
            assert torch.equal(value, results[shard + 2]["architectures"][preset]["shards"][name]), name


@pytest.mark.timeout(900)
def test_degenerate_layouts(results):
    for result in results:
        degenerate = result["degenerate"]
        assert not degenerate["ddp_like_sharded"] and degenerate["ddp_like_replicas"] == 4
        assert degenerate["launched"] == len(degenerate["ddp_like"])  # plain params: autograd's hooks launched
        assert degenerate["one_node_warning"], "a compressing replicator on one node must warn"
        assert degenerate["one_node_local_rows"] == VOCAB // 4  # plain FSDP2 over the 4 ranks
    for key, value in results[0]["degenerate"]["ddp_like"].items():
        for rank in (1, 2, 3):
            assert torch.equal(value, results[rank]["degenerate"]["ddp_like"][key]), (rank, key)
