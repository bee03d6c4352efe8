"""YAML names every callback by its short class name, the generic ones and those that live with their method."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_CODE = """
import sys
from lightning_hetero.cli import build_cli
cli = build_cli(["--config", sys.argv[1], "--config", sys.argv[2]], run=False)
ours = [type(c) for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_hetero")]
print(sorted(f"{c.__module__}.{c.__name__}" for c in ours))
"""


def test_the_cli_knows_each_method_callback_by_its_short_name(tmp_path):
    """In a fresh process (nothing imported beforehand), ``class_path: TierEvaluation`` resolves: the CLI imports
    each strategy's callbacks module from the registry's table."""
    extra = tmp_path / "callbacks.yaml"
    extra.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: CommunicationMonitor\n"
        "    - class_path: TierEvaluation\n"
        "    - class_path: SubspaceRankMonitor\n"
        "    - class_path: GreedyLayerwise\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", _CODE, str(REPO / "configs" / "quickstart.yaml"), str(extra)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == str(
        sorted(
            [
                "lightning_hetero.callbacks.comm_monitor.CommunicationMonitor",
                "lightning_hetero.strategies.layerwise.callbacks.GreedyLayerwise",
                "lightning_hetero.strategies.matformer.callbacks.tier_eval.TierEvaluation",
                "lightning_hetero.strategies.subspace_pipeline.callbacks.SubspaceRankMonitor",
            ]
        )
    )
