"""The CLI on a user's own module file and YAML, for every strategy: ``python -m lightning_hetero fit`` on 2 CPU ranks.

A new user writes ``mynets.py`` for plain Lightning (``cli_mynets.py`` here: loss in ``training_step``, own
dataloaders, no DataModule, nothing of ``lightning_hetero`` in it), puts a YAML next to it and runs
``python -m lightning_hetero fit --config x.yaml`` in that directory. Each case does exactly that in a fresh
directory, in a subprocess whose ``PYTHONPATH`` holds only the repository (standing in for ``pip install -e .``),
never the user's directory: the module is found because the working directory is on ``sys.path``. Lightning starts
the second rank itself (``trainer.devices: 2``).

Each run must exit 0 and log a finite training loss that falls over 6 steps and a finite validation loss (CSV
logger). ``subspace_pipeline`` and ``layerwise`` run their own schedule and do not call the module's
``training_step``/``validation_step`` (by design, see their docs): they log ``train/loss`` and ``val/loss``
themselves, computed by the model from the batch's ``labels``, instead of the user's ``train_loss`` (``layerwise``:
rank 0's own stage loss as ``train/stage0_loss``, the model's as ``train/loss``).
"""

from __future__ import annotations

import csv
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MYNETS = Path(__file__).with_name("cli_mynets.py")

COMMON = """\
seed_everything: 0
model:
  class_path: mynets.{model}
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 6
  log_every_n_steps: 1
  limit_val_batches: 1
  val_check_interval: 6
  num_sanity_val_steps: 0
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: CSVLogger
    init_args:
      save_dir: logs
"""

MATFORMER = """\
  strategy:
    class_path: MatFormerStrategy
    init_args:
      settings:
        tiers: [0, 1]          # rank 1 trains the half-width FFNs
"""

# name: (module class, the YAML's strategy section, the training-loss key, a metric only that strategy logs,
#        a line the strategy prints about what it did with the user's model)
CASES = {
    "flexdemo": (
        "LitLlama",
        "  strategy: flexdemo\n",
        "train_loss",
        "comm/inter/bytes_sent_step",
        "no replicator chosen: using replicator='full'",  # one node, one model copy: no compression by default
    ),
    "matformer": ("LitLlama", MATFORMER, "train_loss", None, None),
    "subspace_pipeline": ("LitLlama", "  strategy: subspace_pipeline\n", "train/loss", None, None),
    "sparseflip": ("LitCNN", "  strategy: sparseflip\n", "train_loss", "lowbit/flips", "low-bit weights"),
    # layerwise: rank 0 (the logger's) trains stage 0, whose own loss is train/stage0_loss every step; train/loss is
    # the model's (the last stage's), which reaches rank 0 a few steps late, so it has fewer rows.
    "layerwise": ("LitLlama", "  strategy: layerwise\n", "train/stage0_loss", "train/loss", None),
}


def _fit(directory: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "lightning_hetero", "fit", "--config", "x.yaml"],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", list(CASES))
def test_user_module_and_yaml_train_through_the_cli(strategy, tmp_path):
    model, section, loss_key, own_metric, printed = CASES[strategy]
    shutil.copy(MYNETS, tmp_path / "mynets.py")
    (tmp_path / "x.yaml").write_text(COMMON.format(model=model) + section)
    result = _fit(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    if printed is not None:
        assert printed in result.stdout + result.stderr
    (metrics,) = (tmp_path / "logs").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    losses = [float(row[loss_key]) for row in rows if row.get(loss_key)]
    assert len(losses) == 6, (loss_key, sorted(rows[0]))
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], losses
    validation = [float(row[key]) for row in rows for key in ("val_loss", "val/loss") if row.get(key)]
    assert validation and all(math.isfinite(value) for value in validation), sorted(rows[0])
    if own_metric is not None:
        assert any(row.get(own_metric) for row in rows), f"{own_metric} not logged: {sorted(rows[0])}"
