"""The ledger is dumped to $LIGHTNING_HETERO_LEDGER_DIR at process exit and read back in rank order."""

from __future__ import annotations

import os
import subprocess
import sys

from lightning_hetero.comm import INTER, SETUP_STEP, ByteLedger, dump_ledger, load_ledger_dumps

SCRIPT = """
from lightning_hetero.comm import get_ledger
get_ledger().set_step(4)
get_ledger().record("all_reduce", "inter", payload_bytes=100, sent=75, received=75, group_size=4)
get_ledger().record("send", "pipeline", payload_bytes=8, sent=8, received=0, group_size=2)
"""


def test_exit_dump_written_when_env_is_set(tmp_path):
    for rank in (1, 0):
        env = {**os.environ, "LIGHTNING_HETERO_LEDGER_DIR": str(tmp_path), "RANK": str(rank), "NODE_RANK": "0"}
        subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True, timeout=120)
    dumps = load_ledger_dumps(tmp_path)
    assert [d["rank"] for d in dumps] == [0, 1]
    assert dumps[0]["node_rank"] == 0
    assert dumps[0]["totals"] == {
        "inter": {"sent": 75, "received": 75, "calls": 1},
        "pipeline": {"sent": 8, "received": 0, "calls": 1},
    }
    assert dumps[0]["steps"]["4"]["inter"] == {"sent": 75, "received": 75, "calls": 1}


def test_no_dump_without_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_HETERO_LEDGER_DIR"}
    subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, check=True, timeout=120)
    assert not list(tmp_path.rglob("ledger-*.json"))


def test_dump_private_ledger(tmp_path):
    ledger = ByteLedger()
    ledger.record("all_gather", INTER, payload_bytes=10, sent=10, received=10, group_size=2)
    path = dump_ledger(tmp_path, ledger)
    (loaded,) = load_ledger_dumps(tmp_path)
    assert path.exists() and loaded["totals"][INTER]["calls"] == 1


def test_setup_traffic_is_dumped_under_step_minus_one(tmp_path):
    script = (
        "from lightning_hetero.comm import get_ledger\n"
        "get_ledger().record('broadcast', 'inter', payload_bytes=64, sent=64, received=0, group_size=2)\n"
        "get_ledger().set_step(0)\n"
        "get_ledger().record('all_reduce', 'inter', payload_bytes=8, sent=8, received=8, group_size=2)\n"
    )
    env = {**os.environ, "LIGHTNING_HETERO_LEDGER_DIR": str(tmp_path), "RANK": "0"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    (dump,) = load_ledger_dumps(tmp_path)
    assert dump["steps"] == {
        str(SETUP_STEP): {"inter": {"sent": 64, "received": 0, "calls": 1}},
        "0": {"inter": {"sent": 8, "received": 8, "calls": 1}},
    }
    assert dump["totals"]["inter"] == {"sent": 72, "received": 8, "calls": 2}
