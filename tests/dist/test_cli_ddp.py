"""The console script under real DDP on CPU: Lightning's own launcher, and two simulated nodes (NODE_RANK).

These run the CLI in subprocesses; `strategy="ddp"` must never run inside the pytest process (its launcher
re-executes the pytest command line in the child).
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hetero.testing import find_free_port

REPO = Path(__file__).resolve().parents[2]


def _command() -> list[str]:
    executable = shutil.which("lightning-hetero")
    return [executable] if executable else [sys.executable, "-m", "lightning_hetero"]


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(REPO / "configs/quickstart.yaml"),
        "--data.init_args.max_chars=400000",
        "--data.init_args.vocab_size=512",
        "--trainer.strategy=ddp",
        "--trainer.max_steps=6",
        "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.callbacks=[]",
        f"--trainer.default_root_dir={out}",
        f"--trainer.logger.init_args.save_dir={out}",
        *extra,
    ]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    return {**env, "HF_HUB_OFFLINE": "1", "LIGHTNING_HETERO_CACHE": str(tmp_path / "cache"), **extra}


def _train_losses(out: Path) -> list[float]:
    (metrics_file,) = out.rglob("metrics.csv")
    return [float(row["train/loss"]) for row in csv.DictReader(metrics_file.open()) if row.get("train/loss")]


@pytest.mark.assets
@pytest.mark.timeout(300)
def test_lightning_launcher_two_processes(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        _command() + _args(out, "--trainer.devices=2"),
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=280,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log
    assert len(_train_losses(out)) == 6


@pytest.mark.assets
@pytest.mark.timeout(300)
def test_two_simulated_nodes_with_node_rank(tmp_path):
    """docs/multinode.md: the same command on each "node" with MASTER_ADDR/PORT and NODE_RANK, num_nodes=2.

    Both nodes prepare data at once (prepare_data runs once per node) into one shared cache: the atomic cache writes
    must make that safe.
    """
    out = tmp_path / "run"
    port = str(find_free_port())
    nodes = [
        subprocess.Popen(
            _command() + _args(out, "--trainer.num_nodes=2", "--trainer.devices=1"),
            cwd=tmp_path,
            env=_env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    logs = []
    try:
        for node in nodes:
            logs.append(node.communicate(timeout=280)[0])
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in logs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in logs[1]
    assert len(_train_losses(out)) == 6


@pytest.mark.slow
@pytest.mark.assets
@pytest.mark.timeout(300)
def test_matformer_config_trains_both_tiers_and_exports_them(tmp_path):
    """configs/matformer_llama_shakespeare.yaml on 2 ranks (tiers [0, 1]): both tiers log losses, exports load."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    args = [
        "fit",
        "--config",
        str(REPO / "configs/matformer_llama_shakespeare.yaml"),
        "--data.init_args.max_chars=400000",
        "--data.init_args.vocab_size=512",
        "--trainer.max_steps=6",
        "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={out}",
        f"--trainer.logger.init_args.save_dir={out}",
    ]
    result = subprocess.run(
        _command() + args, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=280
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    (metrics_file,) = out.rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    for name in ("train/loss_tier0", "train/loss_tier1", "val/loss_tier0", "val/loss_tier1"):
        assert any(row.get(name) for row in rows), name
    sizes = {}
    for tier in (0, 1):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / f"outputs/matformer_llama_shakespeare/tiers/tier{tier}")
        sizes[tier] = model.config.intermediate_size
    assert sizes == {0: 320, 1: 160}
