"""``settings.fault_tolerance`` under a strategy without the fault-tolerant mode (MatFormer, sparseflip, ...): the CLI
says which strategy has it and names docs/spot.md, instead of jsonargparse's "unrecognized arguments"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hetero.cli.spot_errors import fault_tolerance_message

REPO = Path(__file__).resolve().parents[3]

FLAG_ERROR = """Parser key "trainer.strategy":
  Does not validate against any of the types in typing.Union[str, lightning.pytorch.strategies.strategy.Strategy]:
    - Problem with given class_path 'lightning_hetero.MatFormerStrategy':
        unrecognized arguments: --settings.fault_tolerance.min_replicas=2
  Given value type: <class 'jsonargparse._util.NestedArg'>"""


def test_a_fault_tolerance_flag_under_matformer_names_the_strategy_that_has_the_mode():
    message = fault_tolerance_message(FLAG_ERROR)
    assert message is not None and message.startswith("MatFormerStrategy does not run in the fault-tolerant")
    assert "FlexDeMoStrategy with settings.fault_tolerance" in message and "docs/spot.md" in message


def test_other_errors_and_flexdemo_are_left_to_the_other_messages():
    assert fault_tolerance_message(FLAG_ERROR.replace("fault_tolerance", "fault_tol")) is None
    assert fault_tolerance_message(FLAG_ERROR.replace("MatFormerStrategy", "FlexDeMoStrategy")) is None


@pytest.mark.timeout(120)
def test_a_sparseflip_yaml_with_fault_tolerance_is_refused_with_the_spot_message(tmp_path):
    config = tmp_path / "spot.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_hetero.SparseFlipStrategy\n    init_args:\n      settings:\n"
        "        fault_tolerance: {min_replicas: 2}\n"
    )
    command = [sys.executable, "-m", "lightning_hetero", "fit", "--config", str(config), "--print_config"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=110)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: SparseFlipStrategy does not run in the fault-tolerant (spot worker) mode" in done.stderr
    assert "docs/spot.md" in done.stderr and "unrecognized arguments" not in done.stderr
