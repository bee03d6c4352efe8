"""``settings.fault_tolerance`` under a strategy without the fault-tolerant mode (sparseflip, the subspace pipeline,
...): the CLI says which strategies have it (FlexDeMo, MatFormer) and names docs/spot.md, instead of jsonargparse's
"unrecognized arguments"; under FlexDeMo and MatFormer the key is theirs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hetero.cli.spot_errors import fault_tolerance_message

REPO = Path(__file__).resolve().parents[3]

FLAG_ERROR = """Parser key "trainer.strategy":
  Does not validate against any of the types in typing.Union[str, lightning.pytorch.strategies.strategy.Strategy]:
    - Problem with given class_path 'lightning_hetero.SparseFlipStrategy':
        unrecognized arguments: --settings.fault_tolerance.min_replicas=2
  Given value type: <class 'jsonargparse._util.NestedArg'>"""


def test_a_fault_tolerance_flag_under_sparseflip_names_the_strategies_that_have_the_mode():
    message = fault_tolerance_message(FLAG_ERROR)
    assert message is not None and message.startswith("SparseFlipStrategy does not run in the fault-tolerant")
    assert "FlexDeMoStrategy" in message and "MatFormerStrategy" in message and "docs/spot.md" in message
    subspace = fault_tolerance_message(FLAG_ERROR.replace("SparseFlipStrategy", "SubspacePipelineStrategy"))
    assert subspace is not None and subspace.startswith("SubspacePipelineStrategy does not run")


@pytest.mark.parametrize("strategy", ["FlexDeMoStrategy", "MatFormerStrategy"])
def test_other_errors_and_the_strategies_with_the_mode_are_left_to_the_other_messages(strategy):
    assert fault_tolerance_message(FLAG_ERROR.replace("fault_tolerance", "fault_tol")) is None
    assert fault_tolerance_message(FLAG_ERROR.replace("SparseFlipStrategy", strategy)) is None


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
