"""Packing round trips (odd lengths), XOR/AND + popcount matmuls == float matmul, packed safetensors checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_hetero.sparseflip import convert_model, load_packed, lowbit_layers, save_packed
from lightning_hetero.sparseflip.packing import (
    binary_matmul,
    pack_binary,
    pack_signs,
    pack_ternary_2bit,
    pack_ternary_base3,
    packed_matmul,
    popcount,
    unpack_binary,
    unpack_ternary_2bit,
    unpack_ternary_base3,
)

LENGTHS = [0, 1, 3, 4, 5, 7, 8, 9, 63, 64, 65, 1001]


@pytest.mark.parametrize("count", LENGTHS)
def test_ternary_round_trips(count: int, device: torch.device) -> None:
    codes = torch.randint(-1, 2, (count,), generator=torch.Generator().manual_seed(count)).to(torch.int8)
    # Packing is host-side (checkpoints): device codes pack to CPU bytes; device bytes unpack on their device.
    two = pack_ternary_2bit(codes.to(device))
    assert two.numel() == (count + 3) // 4 and torch.equal(unpack_ternary_2bit(two, count), codes)
    assert torch.equal(unpack_ternary_2bit(two.to(device), count).cpu(), codes)
    three = pack_ternary_base3(codes.to(device))
    assert three.numel() == (count + 4) // 5 and torch.equal(unpack_ternary_base3(three, count), codes)
    assert torch.equal(unpack_ternary_base3(three.to(device), count).cpu(), codes)


@pytest.mark.parametrize("count", LENGTHS)
def test_binary_round_trip(count: int, device: torch.device) -> None:
    codes = (torch.randint(0, 2, (count,), generator=torch.Generator().manual_seed(count)) * 2 - 1).to(torch.int8)
    packed = pack_binary(codes.to(device))
    assert packed.numel() == (count + 7) // 8 and torch.equal(unpack_binary(packed, count), codes)
    assert torch.equal(unpack_binary(packed.to(device), count).cpu(), codes)


def test_layouts_by_hand() -> None:
    assert pack_ternary_2bit(torch.tensor([1, -1, 0, 1, -1])).tolist() == [1 | 2 << 2 | 1 << 6, 2]
    assert pack_ternary_base3(torch.tensor([1, -1, 0, 1, -1])).tolist() == [2 + 0 * 3 + 1 * 9 + 2 * 27 + 0 * 81]
    assert pack_binary(torch.tensor([1, -1, -1])).tolist() == [0b110]


def test_unpack_rejects_corruption() -> None:
    with pytest.raises(ValueError, match="code 3"):
        unpack_ternary_2bit(torch.tensor([3], dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match="padding"):
        unpack_ternary_2bit(torch.tensor([0b0100], dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match="242"):
        unpack_ternary_base3(torch.tensor([243], dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="padding"):
        unpack_ternary_base3(torch.tensor([0], dtype=torch.uint8), 1)  # trits 2..5 would be -1
    with pytest.raises(ValueError, match="bytes"):
        unpack_binary(torch.tensor([0, 0], dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="lie in"):
        pack_ternary_2bit(torch.tensor([2]))


def test_popcount(device: torch.device) -> None:
    words = torch.tensor([0, 1, 255, -1, 2**62 + 5], dtype=torch.int64, device=device)
    assert popcount(words).tolist() == [0, 1, 8, 64, 3]
    assert popcount(torch.tensor([0b1011], dtype=torch.uint8, device=device)).tolist() == [3]


@pytest.mark.parametrize("k", [1, 7, 64, 65, 200])
@pytest.mark.parametrize("word_bits", [8, 64])
def test_binary_and_ternary_popcount_matmul_exact(k: int, word_bits: int) -> None:
    gen = torch.Generator().manual_seed(k)
    a = torch.randint(0, 2, (5, k), generator=gen).float() * 2 - 1
    w_bin = torch.randint(0, 2, (6, k), generator=gen).float() * 2 - 1
    w_ter = torch.randint(-1, 2, (6, k), generator=gen).float()
    w_ter[0, 0] = 0  # at least one zero so the ternary path runs
    assert torch.equal(packed_matmul(a, w_bin, word_bits), (a @ w_bin.T).long())
    assert torch.equal(packed_matmul(a, w_ter, word_bits), (a @ w_ter.T).long())
    direct = binary_matmul(pack_signs(a, word_bits), pack_signs(w_bin, word_bits), k)
    assert torch.equal(direct, (a @ w_bin.T).long())


def test_packed_matmul_rejects_non_sign_activations() -> None:
    with pytest.raises(ValueError, match="lie in"):
        packed_matmul(torch.zeros(1, 3), torch.ones(1, 3))


@pytest.mark.parametrize("mode", ["flip", "ste"])
@pytest.mark.parametrize("kind,fmt", [("ternary", "2bit"), ("ternary", "base3"), ("binary", "2bit")])
def test_save_load_packed_exact(tmp_path, mode: str, kind: str, fmt: str) -> None:
    torch.manual_seed(0)
    model = convert_model(
        nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Conv2d(1, 3, 3)), kind, mode, granularity="row"
    )
    sizes = save_packed(model, tmp_path / "m.safetensors", ternary_format=fmt)
    state = load_packed(tmp_path / "m.safetensors")
    per_code = 1 if kind == "binary" else (2 if fmt == "2bit" else 1.6)
    assert sizes["packed_bytes"] <= (35 + 27) * per_code / 8 + 2
    target = convert_model(
        nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Conv2d(1, 3, 3)), kind, "flip", granularity="row"
    )
    target.load_state_dict(state)
    for (_, saved), (_, loaded) in zip(lowbit_layers(model), lowbit_layers(target), strict=True):
        codes, scale = saved.quantized()
        assert torch.equal(loaded.codes, codes) and torch.equal(loaded.scale, scale)
    assert torch.equal(target[1].weight, model[1].weight)
    x = torch.randn(2, 7)
    if mode == "flip":
        assert torch.equal(target[0](x), model[0](x))


def test_load_packed_rejects_missing_metadata(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file({"a.codes.packed": torch.zeros(2, dtype=torch.uint8)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="metadata"):
        load_packed(tmp_path / "bad.safetensors")


# --------------------------------------------------------------------------------------------- forged headers
def _forged(tmp_path, header: object, packed: torch.Tensor | None = None, **tensors: torch.Tensor) -> str:
    """A packed file whose ``layer.codes.packed`` carries ``header`` as its metadata (a dict is JSON-encoded)."""
    from safetensors.torch import save_file

    path = str(tmp_path / "forged.safetensors")
    content = {
        "layer.codes.packed": pack_ternary_2bit(torch.tensor([1, 0, -1, 1, 0, -1])) if packed is None else packed,
        "layer.scale": torch.ones(2),
        **tensors,
    }
    text = header if isinstance(header, str) else json.dumps(header)
    save_file(content, path, metadata={"layer.codes.packed": text})
    return path


def test_a_forged_file_with_a_valid_header_loads(tmp_path) -> None:
    state = load_packed(_forged(tmp_path, {"kind": "ternary", "shape": [2, 3], "format": "2bit"}))
    assert state["layer.codes"].tolist() == [[1, 0, -1], [1, 0, -1]] and state["layer.codes"].dtype == torch.int8


@pytest.mark.parametrize(
    ("header", "field"),
    [
        ({"kind": "ternary", "shape": [-2, -3], "format": "2bit"}, "shape"),
        ({"kind": "ternary", "shape": [2, -3], "format": "2bit"}, "shape"),
        ({"kind": "ternary", "shape": [2.5, 3], "format": "2bit"}, "shape"),
        ({"kind": "ternary", "shape": ["2", "3"], "format": "2bit"}, "shape"),
        ({"kind": "ternary", "shape": [True, 6], "format": "2bit"}, "shape"),
        ({"kind": "ternary", "shape": 6, "format": "2bit"}, "shape"),
        ('{"kind": "ternary", "shape": [1e999], "format": "2bit"}', "shape"),
        ({"kind": "ternary", "shape": [2**70, 2**70], "format": "2bit"}, "shape"),
        ({"kind": "ternary", "shape": [2, 3], "format": "3bit"}, "format"),
        ({"kind": "binary", "shape": [2, 3], "format": "2bit"}, "format"),
        ({"kind": "quaternary", "shape": [2, 3], "format": "2bit"}, "kind"),
        ({"shape": [2, 3], "format": "2bit"}, "kind"),
        ('{"kind": "ternary", "shape": [2, 3], "format": "2bit", "shape": [6]}', "duplicate"),
        ('{"kind": "ternary", "shape": [2, 3], "format": NaN}', "NaN"),
        pytest.param("[" * 100_000, "metadata", id="nesting-bomb"),
        ("not json", "metadata"),
        ([1, 2], "metadata"),
    ],
)
def test_a_forged_header_is_a_value_error_naming_the_field(tmp_path, header, field) -> None:
    with pytest.raises(ValueError, match=f"layer.codes.packed.*{field}"):
        load_packed(_forged(tmp_path, header))


def test_a_packed_layer_needs_a_finite_floating_scale_and_no_second_codes(tmp_path) -> None:
    header = {"kind": "ternary", "shape": [2, 3], "format": "2bit"}
    with pytest.raises(ValueError, match="layer.scale"):
        load_packed(_forged(tmp_path, header, **{"layer.scale": torch.tensor([1.0, float("inf")])}))
    with pytest.raises(ValueError, match="layer.scale"):
        load_packed(_forged(tmp_path, header, **{"layer.scale": torch.ones(2, dtype=torch.int32)}))
    with pytest.raises(ValueError, match="layer.codes"):
        load_packed(_forged(tmp_path, header, **{"layer.codes": torch.zeros(2, 3, dtype=torch.int8)}))


def test_packed_bytes_that_do_not_fit_the_header_are_refused(tmp_path) -> None:
    header = {"kind": "ternary", "shape": [2, 3], "format": "2bit"}
    with pytest.raises(ValueError, match="layer.codes.packed.*uint8 bytes"):
        load_packed(_forged(tmp_path, header, packed=torch.zeros(7, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="layer.codes.packed.*uint8"):
        load_packed(_forged(tmp_path, header, packed=torch.zeros(2, dtype=torch.int16)))


_HEADER_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.none(),
    st.booleans(),
    st.lists(st.integers(-(2**66), 2**66) | st.floats() | st.text(max_size=2), max_size=4),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["ternary", "binary"]) | _HEADER_VALUES,
    shape=st.lists(st.integers(-8, 8), max_size=3) | _HEADER_VALUES,
    fmt=st.sampled_from(["1bit", "2bit", "base3"]) | _HEADER_VALUES,
    packed=st.binary(max_size=6),
)
def test_fuzzed_headers_load_exactly_or_raise_value_error(tmp_path, kind, shape, fmt, packed) -> None:
    """Whatever the header says, load_packed returns codes of the announced shape in {-1, 0, 1} or a ValueError."""
    data = torch.tensor(list(packed), dtype=torch.uint8)
    try:
        path = _forged(tmp_path, json.dumps({"kind": kind, "shape": shape, "format": fmt}), packed=data)
    except (ValueError, OverflowError):  # json.dumps of a value the test cannot encode: nothing to load
        return
    try:
        state = load_packed(path)
    except ValueError:
        return
    codes = state["layer.codes"]
    assert codes.dtype == torch.int8 and list(codes.shape) == shape
    assert bool(((codes >= -1) & (codes <= 1)).all())
    if kind == "binary":
        assert not bool((codes == 0).any())
