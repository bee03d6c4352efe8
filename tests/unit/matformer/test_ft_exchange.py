"""MatFormer's fault-tolerant exchange (``matformer/ft_exchange.py``): the per-region mean over participants of
different tiers against hand-computed values, bit-identical results on every node, and refused payloads."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError
from lightning_hetero.matformer.ft_exchange import (
    MAGIC,
    VERSION,
    decode_payload,
    encode_payload,
    exchange_gradients,
    gradient_specs,
    payload_bytes,
    region_mean,
)
from lightning_hetero.matformer.types import FFNParameter

# One FFN of hidden size 4 (an input projection [4, 3] along axis 0, an output projection [2, 4] along axis 1) and a
# shared bias of 3: the smallest model with a region trained by every tier and one trained by tier 0 only.
SHAPES = {"ffn.down": (2, 4), "ffn.up": (4, 3), "norm": (3,)}
FFN = [FFNParameter("ffn.up", 0, 4, 0), FFNParameter("ffn.down", 1, 4, 0)]
SPECS = gradient_specs(SHAPES, FFN)
FULL = [4]


def _grads(value: float, width: int) -> dict[str, torch.Tensor]:
    """A node's gradient: ``value`` everywhere it trained (its prefix of width ``width``), exact zeros beyond."""
    up = torch.zeros(4, 3)
    up[:width] = value
    down = torch.zeros(2, 4)
    down[:, :width] = value
    return {"ffn.down": down, "ffn.up": up, "norm": torch.full((3,), value)}


def _gather(payloads: list[torch.Tensor]):
    return lambda own: payloads


def test_the_wire_order_is_by_name_with_the_ffn_axis_and_layer():
    assert [(s.name, s.axis, s.layer) for s in SPECS] == [("ffn.down", 1, 0), ("ffn.up", 0, 0), ("norm", None, None)]
    assert payload_bytes(SPECS, 1) == 4 * (4 + 1) + 4 * (8 + 12 + 3) == 112
    assert encode_payload([4], _grads(1.0, 4), SPECS).numel() == 112


def _node(index: int, value: float, width: int) -> object:
    """Participant ``index``'s payload as every node decodes it."""
    return decode_payload(encode_payload([width], _grads(value, width), SPECS), SPECS, FULL, index)


def test_per_region_mean_over_tiers_0_1_1_matches_the_hand_computed_values():
    # Tier 0 (width 4) sends 3, the two tier-1 nodes (width 2) send 6 and 9.
    nodes = [_node(0, 3.0, 4), _node(1, 6.0, 2), _node(2, 9.0, 2)]
    mean = region_mean(nodes, SPECS, FULL)
    down, up, norm = mean[:8].view(2, 4), mean[8:20].view(4, 3), mean[20:]
    # Hidden units 0-1: trained by all three, (3 + 6 + 9) / 3 = 6; units 2-3: by the tier-0 node alone, 3 / 1 = 3.
    assert torch.equal(up, torch.tensor([[6.0] * 3, [6.0] * 3, [3.0] * 3, [3.0] * 3]))
    assert torch.equal(down, torch.tensor([[6.0, 6.0, 3.0, 3.0]] * 2))
    assert torch.equal(norm, torch.full((3,), 6.0))  # shared: every node


def test_a_region_nobody_in_the_quorum_trains_gets_a_zero_gradient():
    # The tier-0 node is away: two tier-1 nodes (2 and 4) leave units 2-3 untrained.
    nodes = [_node(0, 2.0, 2), _node(1, 4.0, 2)]
    up = region_mean(nodes, SPECS, FULL)[8:20].view(4, 3)
    assert torch.equal(up, torch.tensor([[3.0] * 3, [3.0] * 3, [0.0] * 3, [0.0] * 3]))


def test_per_layer_widths_give_each_layer_its_own_regions():
    shapes = {"l0.up": (4, 1), "l1.up": (8, 1)}
    ffn = [FFNParameter("l0.up", 0, 4, 0), FFNParameter("l1.up", 0, 8, 1)]
    specs = gradient_specs(shapes, ffn)
    widths = [[4, 2], [2, 8]]  # node 0: full layer 0, quarter of layer 1; node 1 the other way round
    nodes = []
    for index, (value, width) in enumerate(zip([2.0, 4.0], widths, strict=True)):
        grads = {"l0.up": torch.full((4, 1), value), "l1.up": torch.full((8, 1), value)}
        nodes.append(decode_payload(encode_payload(width, grads, specs), specs, [4, 8], index))
    mean = region_mean(nodes, specs, [4, 8])
    assert mean[:4].tolist() == [3.0, 3.0, 2.0, 2.0]  # layer 0: units 0-1 both, 2-3 node 0 only
    assert mean[4:].tolist() == [3.0, 3.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]  # layer 1: units 2-7 node 1 only


def test_every_node_writes_the_same_bits_and_units_beyond_the_own_width_are_not_sent():
    torch.manual_seed(0)
    widths = [4, 2, 2]
    # Random values beyond a node's width too: they are zeroed before sending.
    local = [{name: torch.randn(shape) for name, shape in SHAPES.items()} for _ in widths]
    payloads = [encode_payload([w], g, SPECS) for w, g in zip(widths, local, strict=True)]
    seen = [exchange_gradients(_gather(payloads), [w], g, SPECS, FULL) for w, g in zip(widths, local, strict=True)]
    assert seen == [[(4,), (2,), (2,)]] * 3
    for name in SHAPES:
        assert torch.equal(local[0][name], local[1][name]) and torch.equal(local[0][name], local[2][name]), name


def _tampered(width: int = 2, **changes: object) -> torch.Tensor:
    payload = encode_payload([width], _grads(1.0, width), SPECS)
    header = payload[:20].view(torch.int32)
    values = payload[20:].view(torch.float32)
    for key, value in changes.items():
        if key == "header":
            index, word = value  # type: ignore[misc]
            header[index] = word
        elif key == "value":
            index, number = value  # type: ignore[misc]
            values[index] = number
    return payload


@pytest.mark.parametrize(
    ("payload", "field", "says"),
    [
        (_tampered()[:-4], "payload", "has 108 bytes, this node's model needs 112"),
        (_tampered(header=(0, 0)), "header", "expected [magic, version 1, 1 FFN layers, 23 elements]"),
        (_tampered(header=(1, VERSION + 1)), "header", "version 1"),
        (_tampered(header=(3, 22)), "header", "23 elements"),
        (_tampered(header=(4, 0)), "header.widths[0]", "is 0, outside [1, 4]"),
        (_tampered(header=(4, 8)), "header.widths[0]", "is 8, outside [1, 4]"),
        (_tampered(value=(0, float("nan"))), "gradient", "holds NaN/Inf"),
        (_tampered(value=(21, float("inf"))), "gradient", "holds NaN/Inf"),
        (_tampered(value=(1, 10 * MAX_PEER_MAGNITUDE)), "gradient", "holds a value of magnitude"),
        # width 2 claimed, but ffn.down[0, 3] (flat index 3) and ffn.up[2, 0] (8 + 6) are non-zero: a tier-0 gradient
        (_tampered(value=(3, 0.5)), "gradient[ffn.down]", "non-zero beyond its width 2 (layer 0)"),
        (_tampered(value=(14, -0.5)), "gradient[ffn.up]", "its tier does not match its gradient"),
    ],
)
def test_an_inconsistent_payload_is_refused_naming_the_participant_and_the_field(payload, field, says):
    with pytest.raises(PeerPayloadError, match="participant 1") as error:
        decode_payload(payload, SPECS, FULL, 1)
    assert error.value.field == field and error.value.peer == 1
    assert says in str(error.value) and "the step is discarded" in str(error.value)


def test_a_refused_payload_leaves_every_gradient_as_it_was():
    mine = _grads(1.0, 4)
    before = {name: grad.clone() for name, grad in mine.items()}
    payloads = [encode_payload([4], mine, SPECS), _tampered(value=(3, 0.5))]
    with pytest.raises(PeerPayloadError):
        exchange_gradients(_gather(payloads), [4], mine, SPECS, FULL)
    assert all(torch.equal(mine[name], before[name]) for name in mine)


def test_the_header_is_the_documented_int32_words():
    payload = encode_payload([2], _grads(1.0, 2), SPECS)
    assert payload[:20].view(torch.int32).tolist() == [MAGIC, VERSION, 1, 23, 2]


def test_specs_refuse_a_sliced_ffn_or_a_missing_parameter():
    with pytest.raises(ValueError, match="slice_weights=False"):
        gradient_specs({**SHAPES, "ffn.up": (2, 3)}, FFN)
    with pytest.raises(ValueError, match="not trainable parameters"):
        gradient_specs({"norm": (3,)}, FFN)
