"""The fault-tolerant MatFormer runtime in one process: a node's setup (its tier from its replica group, the full model
masked, the wire order) and its gradient sync over a quorum, given the payloads a peer would send (the gather stands in
for torchft's authenticated all-gather; tests/dist/test_ft_matformer.py runs the real one)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.matformer.ft_exchange import encode_payload
from lightning_hetero.matformer.runtime import MatFormerRuntime
from lightning_hetero.matformer.settings import MatFormerSettings
from tests.token_data import TINY_LLAMA, progressions

SETTINGS = MatFormerSettings(
    tiers=[0, 1, 1], slice_weights=False, fault_tolerance=FaultToleranceSettings(num_replica_groups=3)
)
FULL, HALF = 64, 32


class _Manager:
    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def report_error(self, error: Exception) -> None:
        self.errors.append(error)


class _Replica:
    """Stands in for FaultTolerantReplica's transport: participant 0 is a peer (its fixed payload), 1 this node."""

    def __init__(self, peer: torch.Tensor) -> None:
        self.peer, self.manager = peer, _Manager()

    def gather_bytes(self, payload: torch.Tensor) -> list[torch.Tensor]:
        return [self.peer, payload]


def _node(monkeypatch: pytest.MonkeyPatch, group: int) -> tuple[MatFormerRuntime, LlamaForCausalLM]:
    monkeypatch.setenv("REPLICA_GROUP_ID", f"node-{group}")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    runtime = MatFormerRuntime(SETTINGS)
    runtime.setup(model, torch.device("cpu"), lambda: 0)
    return runtime, model


def _backward(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    batch = progressions(2)
    model(input_ids=torch.stack([b["input_ids"] for b in batch]), labels=torch.stack([b["labels"] for b in batch]))[
        "loss"
    ].backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_tier1_node_holds_the_full_model_and_trains_its_prefix(monkeypatch):
    runtime, model = _node(monkeypatch, 2)
    assert runtime.per_rank == [1] and runtime.tier_of(0) == 1 and runtime.local_widths == [HALF, HALF]
    assert not runtime.sliced and runtime._mask_handles  # masked, never sliced: any node can heal any other
    assert [spec.name for spec in runtime.ft_specs] == sorted(name for name, _ in model.named_parameters())
    grads = _backward(model)
    up = grads["model.layers.0.mlp.up_proj.weight"]
    assert up.shape[0] == FULL and up[HALF:].count_nonzero() == 0 and up[:HALF].count_nonzero() > 0


def test_the_sync_forms_the_per_region_mean_with_a_tier0_peer(monkeypatch):
    runtime, model = _node(monkeypatch, 1)
    own = _backward(model)
    generator = torch.Generator().manual_seed(1)
    peer = {name: torch.randn(g.shape, generator=generator) for name, g in own.items()}  # a tier-0 node's gradient
    runtime.quorum.replica = _Replica(encode_payload([FULL, FULL], peer, runtime.ft_specs))
    runtime.sync_gradients(model, 0)
    assert runtime.participant_widths == [(FULL, FULL), (HALF, HALF)]
    grads = dict(model.named_parameters())
    for spec in runtime.ft_specs:
        got = grads[spec.name].grad
        if spec.axis is None:  # shared by both: their mean
            assert torch.equal(got, (peer[spec.name] + own[spec.name]) / 2), spec.name
            continue
        both = (peer[spec.name] + own[spec.name]) / 2
        expected = torch.cat(
            [both.narrow(spec.axis, 0, HALF), peer[spec.name].narrow(spec.axis, HALF, HALF)], spec.axis
        )
        assert torch.equal(got, expected), spec.name  # the prefix: both nodes; units 32-63: the tier-0 peer alone


def test_a_refused_peer_payload_fails_the_commit_and_applies_nothing(monkeypatch):
    runtime, model = _node(monkeypatch, 1)
    own = _backward(model)
    peer: dict[str, Any] = {name: torch.ones_like(g) for name, g in own.items()}
    payload = encode_payload([FULL, FULL], peer, runtime.ft_specs)
    payload[16:20].view(torch.int32).fill_(HALF)  # it claims tier 1 in layer 0 but sends a full-width gradient
    replica = _Replica(payload)
    runtime.quorum.replica = replica
    runtime.sync_gradients(model, 0)
    (error,) = replica.manager.errors
    assert isinstance(error, PeerPayloadError) and error.peer == 0 and "beyond its width 32 (layer 0)" in str(error)
    assert all(torch.equal(p.grad, own[name]) for name, p in model.named_parameters())


def test_a_tier1_node_evaluates_the_whole_model_every_node_holds(monkeypatch):
    runtime, model = _node(monkeypatch, 2)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))  # the same weights, no masks
    ids = torch.stack([b["input_ids"] for b in progressions(2)])
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)  # TierEvaluation's tier 0
        model.train()
        assert not torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)  # trains its prefix
