"""The pipelines' export gather (subspace, decoupled layerwise): what a stage sends to rank 0 is bounded,
safetensors-only and finite.

A hostile or corrupt stage can announce a negative or huge size, send bytes that are not a safetensors file, or send
NaN weights. Rank 0 refuses each with a ``PeerPayloadError`` naming the stage's rank and the field, before allocating
anything for a size outside the bound. The pure decoder is fuzzed single-process; one spawned 2-rank gloo run drives
the real gather with a forging sender.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as save_safetensors

from lightning_hetero import comm
from lightning_hetero.comm.validation import PeerPayloadError
from lightning_hetero.pipeline.layout import PipelineLayout
from lightning_hetero.pipeline.stage_gather import (
    EXPORT_LABEL,
    decode_stage_state,
    gather_stage_states,
    stage_bytes_limit,
)
from lightning_hetero.subspace_pipeline import SubspaceConfig, build_stages
from lightning_hetero.testing import run_distributed
from tests.payload_rule import assert_decoder_rule, gather_outcome
from tests.unit.subspace_pipeline._tiny import fresh, tiny_model

FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
STATE = {"layer.weight_coords": torch.linspace(-1.0, 1.0, 12).reshape(3, 4), "steps": torch.tensor([7])}
VALID = save_safetensors(STATE)


def test_a_stage_state_round_trips():
    decoded = decode_stage_state(torch.frombuffer(bytearray(VALID), dtype=torch.uint8), peer=1)
    assert decoded.keys() == STATE.keys() and all(torch.equal(decoded[k], v) for k, v in STATE.items())


def test_bytes_that_are_not_safetensors_are_refused_naming_the_stage():
    with pytest.raises(PeerPayloadError, match="export.payload from rank 3 could not be decoded") as caught:
        decode_stage_state(b"\x80" * 64, peer=3)
    assert (caught.value.peer, caught.value.field) == (3, "export.payload")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3e38])
def test_non_finite_or_overflowing_weights_are_refused_naming_the_key(bad):
    forged = dict(STATE, **{"layer.weight_coords": STATE["layer.weight_coords"].clone()})
    forged["layer.weight_coords"][1, 2] = bad
    with pytest.raises(PeerPayloadError) as caught:
        decode_stage_state(save_safetensors(forged), peer=2)
    assert (caught.value.peer, caught.value.field) == (2, "export.layer.weight_coords")


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_keep_the_decoder_rule(data):
    assert_decoder_rule(lambda: decode_stage_state(data, peer=1), peer=1)


def _same_layout(result: dict[str, torch.Tensor]) -> None:
    # One corrupted byte may rename a key or change a value, never add a tensor or change a size.
    assert len(result) == len(STATE)
    assert sorted(t.numel() * t.element_size() for t in result.values()) == sorted(
        t.numel() * t.element_size() for t in STATE.values()
    )


@FUZZ
@given(st.integers(0, len(VALID) - 1), st.integers(0, 255))
def test_a_valid_state_with_one_corrupted_byte_keeps_the_decoder_rule(position, value):
    forged = bytearray(VALID)
    forged[position] = value
    assert_decoder_rule(lambda: decode_stage_state(bytes(forged), peer=1), peer=1, check_layout=_same_layout)


def test_the_bound_from_the_config_holds_every_stage_of_that_model():
    model = tiny_model()
    stages = build_stages(fresh(model), SubspaceConfig(subspace_dim=8), 2, [0, 1])
    limit = stage_bytes_limit(model.config)
    for stage in stages:
        assert len(save_safetensors({k: v.contiguous() for k, v in stage.state_dict().items()})) <= limit
    assert limit < 64 * sum(p.numel() for p in model.parameters())  # a bound of this model, not of any model


# --------------------------------------------------------------------------------------------- spawned gather
def _forge(kind: str) -> tuple[int, bytes | None]:
    """What the hostile stage announces and then sends (None: only the size)."""
    if kind == "negative size":
        return -5, None
    if kind == "2**50 size":
        return 2**50, None
    if kind == "above max_bytes":
        return 4096, None
    if kind == "bogus safetensors":
        return 64, b"\x80" * 64
    if kind == "NaN weights":
        payload = save_safetensors({"w": torch.tensor([1.0, float("nan")])})
        return len(payload), payload
    payload = save_safetensors({"w": torch.tensor([1.0, 2.0])})  # honest
    return len(payload), payload


KINDS = ["negative size", "2**50 size", "above max_bytes", "bogus safetensors", "NaN weights", "honest"]


def _gather_worker(rank: int, world_size: int) -> list[Any]:
    layout = PipelineLayout(num_stages=2)
    device = torch.device("cpu")
    out: list[Any] = []
    for kind in KINDS:
        max_bytes = 1024 if kind == "above max_bytes" else None
        if rank == 1:  # the hostile stage: it sends what it likes instead of calling gather_stage_states
            size, payload = _forge(kind)
            comm.send(torch.tensor([size], dtype=torch.int64), 0, label=EXPORT_LABEL)
            if payload is not None:
                comm.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, label=EXPORT_LABEL)
            continue
        out.append(
            gather_outcome(
                lambda bound=max_bytes: gather_stage_states({"v": torch.ones(2)}, layout, 0, device, max_bytes=bound),
                lambda states: ([sorted(s) for s in states], states[1]["w"].tolist()),
            )
        )
    return out


@pytest.mark.timeout(120)
def test_the_gather_refuses_forged_sizes_and_payloads_before_allocating():
    results = run_distributed(_gather_worker, 2, timeout=90)[0]
    outcome = dict(zip(KINDS, results, strict=True))
    for kind in KINDS[:-1]:
        assert outcome[kind][:2] == ("refused", 1), (kind, outcome[kind])
    for kind in ("negative size", "2**50 size", "above max_bytes"):
        assert outcome[kind][2] == "export.size" and "refusing it before allocating" in outcome[kind][3], kind
    assert "[8, 1024]" in outcome["above max_bytes"][3]
    assert outcome["bogus safetensors"][2] == "export.payload"
    assert outcome["NaN weights"][2] == "export.w"
    assert outcome["honest"] == ("accepted", ([["v"], ["w"]], [1.0, 2.0]))
