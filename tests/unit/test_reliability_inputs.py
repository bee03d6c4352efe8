"""The hostile-input catalogue (``recipes/reliability_inputs.py``): every forged input is refused, nothing crashes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _recipe():
    spec = importlib.util.spec_from_file_location("reliability_inputs", REPO / "recipes" / "reliability_inputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_forged_input_is_rejected_and_no_input_crashes_or_is_applied_invalid(tmp_path, monkeypatch):
    out = tmp_path / "reliability_inputs.json"
    monkeypatch.setattr(sys, "argv", ["reliability_inputs.py", "--random-cases", "3", "--out", str(out)])
    _recipe().main()
    result = json.loads(out.read_text())
    assert result["crashed"] == 0 and result["accepted_invalid"] == 0
    assert result["forged_inputs_rejected"] == result["forged_inputs_tried"] >= 30
    assert result["bad_inputs_tried"] == len(result["cases"]) == result["forged_inputs_tried"] + 4 * 3
    decoders = {case["decoder"].split()[0] for case in result["cases"]}
    assert {"flexdemo", "lowbit", "matformer", "core", "subspace", "comm.codecs", "testbed"} <= decoders
    pickle_case = next(c for c in result["cases"] if c["input"] == "malicious pickle")
    assert pickle_case["outcome"] == "rejected" and pickle_case["error"].startswith("UnpicklingError")
