"""The hostile-input catalogue (``recipes/reliability/reliability_inputs.py``): every forged input is refused, nothing
crashes.

The recipe runs for real (3 random cases per family; its two collective gathers on 2 spawned gloo ranks). Its five
counts must add up, every attack of issue 21 must have its row, and the outcome rules themselves are checked on
known inputs: an escaped RuntimeError is a crash, a pickle that ran code is a crash whatever was raised after it, a
forged input accepted is ``accepted_invalid`` even when it decoded to finite values, and random bytes are
``accepted_valid`` only when finite, bounded and of the announced layout.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lightning_hetero.comm.validation import MAX_PEER_MAGNITUDE, PeerPayloadError

REPO = Path(__file__).resolve().parents[3]
ISSUE_21_INPUTS = {
    "malicious pickle, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1",
    "malicious pickle, weights_only=False",
    "8 DCT coefficients of 3.4e38 in one column",
    "ternary code 3",
    "negative sign scale",
    "negative ternary scale",
    "duplicate indices",
    "two finite 3e38 fp lists combined",
    "int8 byte -128 with a scale just under float32 max / 127",
    "4 GiB announced for one message",
    "negative size",
    "2**50 size",
    "bogus safetensors",
    "NaN weights",
    "numel 2**31",
    "newer manifest without step",
    "newer manifest with a non-integer step",
    "newer manifest of another version",
    "every manifest gone",
    "one flipped bit, with a manifest",
    "1e999 (parses to inf)",
    "duplicate keys",
    "negative shape",
}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "recipes" / "reliability" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_every_forged_input_is_rejected_and_no_input_crashes_or_is_applied_invalid(tmp_path, monkeypatch):
    out = tmp_path / "reliability_inputs.json"
    monkeypatch.setattr(sys, "argv", ["reliability_inputs.py", "--random-cases", "3", "--out", str(out)])
    _load("reliability_inputs").main()
    result = json.loads(out.read_text())
    five = ("bad_inputs_rejected", "accepted_valid", "accepted_invalid", "crashed")
    assert result["bad_inputs_tried"] == len(result["cases"]) == sum(result[key] for key in five)
    assert result["bad_inputs_tried"] == result["forged_inputs_tried"] + 7 * 3  # 7 random-bytes families
    assert ISSUE_21_INPUTS <= {case["input"] for case in result["cases"]}
    pickles = [c for c in result["cases"] if c["input"].startswith("malicious pickle")]
    assert len(pickles) == 6  # core load_part, MatFormer and sparseflip x (env var, weights_only=False), Fabric
    decoders = {case["decoder"].split()[0] for case in result["cases"]}
    assert {
        "flexdemo",
        "lowbit",
        "matformer",
        "core",
        "subspace",
        "comm.payload_packing",
        "testbed",
        "layerwise",
        "ft",
    } <= decoders
    # The target: nothing crashes, nothing invalid is accepted, every forged input is refused.
    failures = [c for c in result["cases"] if c["outcome"] in ("accepted_invalid", "crashed")]
    assert result["crashed"] == 0 and result["accepted_invalid"] == 0, failures
    assert result["forged_inputs_rejected"] == result["forged_inputs_tried"] >= 60
    assert all(c["error"].startswith("UnpicklingError") for c in pickles), pickles


def test_the_outcome_rules(monkeypatch):
    recipe = _load("reliability_inputs")
    finite, huge = torch.ones(2), torch.full((2,), 2 * MAX_PEER_MAGNITUDE)

    def code_ran() -> None:
        try:
            raise pickle_error
        finally:
            raise recipe.CodeRan("the marker file appeared")

    pickle_error = __import__("pickle").UnpicklingError("refused, but too late")
    cases = [
        ("d", "forged, refused", lambda: (_ for _ in ()).throw(PeerPayloadError("no", 1, "values")), recipe._forged),
        ("d", "forged, KeyError escapes", lambda: {}["step"], recipe._forged),
        ("d", "forged, RuntimeError escapes", lambda: torch.empty(-1), recipe._forged),
        ("d", "forged, code ran", code_ran, recipe._forged),
        ("d", "forged, accepted finite", lambda: finite, recipe._forged),
        ("d", "forged, skipped", lambda: (_ for _ in ()).throw(recipe.Refused("fell back")), recipe._forged),
        ("d", "random bytes (seed 0)", lambda: finite, recipe._valid),
        ("d", "random bytes (seed 1)", lambda: huge, recipe._valid),
        ("d", "random bytes (seed 2)", lambda: torch.tensor([float("inf")]), recipe._valid),
        ("d", "random bytes (seed 3)", lambda: torch.ones(3), recipe._shaped((2,))),
    ]
    monkeypatch.setattr(recipe, "catalogue", lambda random_cases: cases)
    result = recipe.run(0)
    outcomes = [case["outcome"] for case in result["cases"]]
    assert outcomes == [
        "rejected",
        "crashed",
        "crashed",
        "crashed",
        "accepted_invalid",
        "rejected",
        "accepted_valid",
        "accepted_invalid",
        "accepted_invalid",
        "accepted_invalid",
    ]
    assert (result["bad_inputs_tried"], result["bad_inputs_rejected"], result["accepted_valid"]) == (10, 2, 1)
    assert (result["accepted_invalid"], result["crashed"]) == (4, 3)
    assert (result["forged_inputs_tried"], result["forged_inputs_rejected"]) == (6, 2)


def test_the_aggregate_carries_the_five_counts(tmp_path, monkeypatch):
    bench = _load("bench_reliability")
    counts = {"bad_inputs_tried": 9, "bad_inputs_rejected": 5, "accepted_valid": 1, "accepted_invalid": 2, "crashed": 1}
    (tmp_path / "reliability_inputs.json").write_text(json.dumps({**counts, "cases": []}))
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "FAULTS_FILE", tmp_path / "reliability_faults.json")
    monkeypatch.setattr(bench, "SUMMARY_FILE", tmp_path / "reliability.json")
    summary = bench.aggregate()
    assert json.loads((tmp_path / "reliability.json").read_text()) == summary
    carried = {key: summary[key] for key in summary if key.startswith("bad_inputs_")}
    assert carried == {
        "bad_inputs_tried": 9,
        "bad_inputs_rejected": 5,
        "bad_inputs_accepted_valid": 1,
        "bad_inputs_accepted_invalid": 2,
        "bad_inputs_crashed": 1,
    }
    assert summary["sources"]["inputs"] == "reliability_inputs.json"
